"""Throwaway PostgreSQL, MariaDB and Redis servers a test may stop, kill and restart.

Resilience to a store or broker outage is shown by taking a real server away, never the
machine's own: each of these runs on a free port under a temporary directory and is removed
by ``destroy()``.
"""

from __future__ import annotations

import getpass
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import OperationalError

from celery_resilient.testing.waiting import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drop_prefixed_tables(url: str, prefix: str) -> None:
    """Drop every table whose name starts with ``prefix`` (a test's or benchmark's own store).

    On PostgreSQL a session that still holds a lock on one of them (a worker's, left behind
    a link a test silenced, its transaction open until the server hears of its end) is
    ended after 10 s of waiting, instead of holding the drop until the test times out."""
    engine = create_engine(url)
    try:
        for attempt in range(3):
            try:
                with engine.begin() as conn:
                    postgresql = conn.dialect.name == "postgresql"
                    if postgresql:
                        conn.execute(text("SET LOCAL lock_timeout = '10s'"))
                    quote = conn.dialect.identifier_preparer.quote_identifier
                    cascade = " CASCADE" if postgresql else ""
                    for name in inspect(conn).get_table_names():
                        if name.startswith(prefix):
                            conn.execute(text(f"DROP TABLE IF EXISTS {quote(name)}{cascade}"))
                return
            except OperationalError:
                if engine.dialect.name != "postgresql" or attempt == 2:
                    raise
                with engine.begin() as conn:
                    conn.execute(text(
                        "SELECT pg_terminate_backend(l.pid) FROM pg_locks l "
                        "JOIN pg_class c ON c.oid = l.relation "
                        "WHERE starts_with(c.relname, :prefix) AND l.pid <> pg_backend_pid()"),
                        {"prefix": prefix})
    finally:
        engine.dispose()


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(
        f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise RuntimeError(f"{name} not found: install the PostgreSQL server binaries")
    return found


class StoreServer(Protocol):
    """A throwaway store server a test or a chaos run takes away and brings back: what
    :class:`ThrowawayPostgres` and :class:`ThrowawayMariaDB` both offer (``STORE_SERVERS``)."""

    #: The server's product name, for log lines ("PostgreSQL", "MariaDB").
    name: str
    #: How :meth:`stop_immediately` takes it away, for log lines.
    stopped_how: str
    #: The store URL by 127.0.0.1 (a database the store may use).
    url: str
    port: int
    max_connections: int
    #: Addresses besides 127.0.0.1 it listens on, and accepts the URL's user from.
    also_listen: list[str]

    def init(self) -> StoreServer: ...

    def start(self) -> None: ...

    def stop_immediately(self) -> None: ...

    def url_on(self, host: str) -> str: ...

    def destroy(self) -> None: ...


class ThrowawayPostgres:
    """A PostgreSQL cluster of its own (``initdb``), run as ``postgres`` when we are root."""

    name = "PostgreSQL"
    stopped_how = "stopped (-m immediate)"

    def __init__(self, max_connections: int = 100, also_listen: Sequence[str] = (),
                 settings: Sequence[str] = ()) -> None:
        #: Addresses besides 127.0.0.1 it listens on, and accepts anyone from (tests only).
        self.also_listen = list(also_listen)
        #: Server settings (``name=value``) it starts with, e.g. ``shared_preload_libraries=...``.
        self.settings = list(settings)
        self.dir = Path(tempfile.mkdtemp(prefix="resilient-pg-", dir="/tmp"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        self.max_connections = max_connections
        # initdb refuses to run as root: run the cluster as the postgres account then.
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.dir, self.user)
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        subprocess.run(argv, check=True, user=self.user, capture_output=True, timeout=120)

    def init(self) -> ThrowawayPostgres:
        self._run(_pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "--no-sync", "-E", "UTF8")
        if self.also_listen:
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write("host all all 0.0.0.0/0 trust\n")
        return self

    def url_on(self, host: str) -> str:
        """The URL by one of its other addresses."""
        return self.url.replace("@127.0.0.1:", f"@{host}:")

    def start(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-o", f"-p {self.port} -k {self.dir} -c listen_addresses="
                  f"{','.join(['127.0.0.1', *self.also_listen])} "
                  f"-c max_connections={self.max_connections}"
                  + "".join(f" -c {setting}" for setting in self.settings), "start")

    def postmaster_pid(self) -> int:
        """The server's main process (the first line of ``postmaster.pid``)."""
        return int((self.data / "postmaster.pid").read_text().split()[0])

    def stop_immediately(self) -> None:
        """The outage: every backend killed at once, no shutdown checkpoint."""
        self._run(_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def read_only(self, on: bool) -> None:
        """What clients meet when a failover sends them to a standby: every transaction
        read-only (SQLSTATE 25006 on a write), applied to open sessions by a reload."""
        engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text("SET default_transaction_read_only = off"))
                conn.execute(text("ALTER SYSTEM SET default_transaction_read_only = "
                                  + ("on" if on else "off")))
                conn.execute(text("SELECT pg_reload_conf()"))
        finally:
            engine.dispose()

    def running(self) -> bool:
        return subprocess.run([_pg_bin("pg_ctl"), "-D", str(self.data), "status"],
                              check=False, user=self.user, capture_output=True).returncode == 0

    def destroy(self) -> None:
        if self.data.exists() and self.running():
            self.stop_immediately()
        shutil.rmtree(self.dir, ignore_errors=True)


class ThrowawayMariaDB:
    """A MariaDB server of its own (``mariadb-install-db``, ``mariadbd``), run as root when we
    are (``--user``); a ``test`` database; ``stop_immediately`` is a SIGKILL."""

    name = "MariaDB"
    stopped_how = "SIGKILLed"

    def __init__(self, max_connections: int = 151, also_listen: Sequence[str] = (),
                 driver: str = "pymysql") -> None:
        #: Addresses besides 127.0.0.1 it listens on (MariaDB 10.11 takes a list), and
        #: accepts ``root`` from, without a password (``'root'@'%'``: tests only).
        self.also_listen = list(also_listen)
        self.max_connections = max_connections
        binary = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        if not os.path.exists(binary):
            raise RuntimeError("mariadbd not found: install MariaDB")
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="resilient-mariadb-", dir="/tmp"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.user = "root" if os.geteuid() == 0 else getpass.getuser()
        #: Through ``driver``: ``pymysql`` or ``mysqldb`` (mysqlclient).
        self.url = f"mysql+{driver}://root@127.0.0.1:{self.port}/test"
        self.process: subprocess.Popen[bytes] | None = None

    def init(self) -> ThrowawayMariaDB:
        """Create the data directory; once more from scratch if the first try failed (two
        run at the same moment have failed once in the suite), its output in the error."""
        for _attempt in (1, 2):
            done = subprocess.run(
                ["mariadb-install-db", "--no-defaults", f"--datadir={self.data}",
                 f"--user={self.user}", "--auth-root-authentication-method=normal",
                 "--skip-test-db"], check=False, capture_output=True, timeout=120)
            if done.returncode == 0:
                return self
            shutil.rmtree(self.data, ignore_errors=True)
        raise RuntimeError(f"mariadb-install-db exited {done.returncode} twice: "
                           + (done.stdout + done.stderr).decode(errors="replace")[-2000:])

    def url_on(self, host: str) -> str:
        """The URL by one of its other addresses (``also_listen``)."""
        return self.url.replace("@127.0.0.1:", f"@{host}:")

    @property
    def app_url(self) -> str:
        """The ``test`` database as an application's user (all rights on it, no server
        administration), whom :meth:`read_only` refuses every write."""
        return self.url.replace("//root@", "//app@")

    def read_only(self, on: bool) -> None:
        """What clients meet when a failover sends them to a replica: ``read_only``, every
        write by a user without ``READ ONLY ADMIN`` refused (error 1290), open sessions
        included."""
        engine = create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text(f"SET GLOBAL read_only = {'ON' if on else 'OFF'}"))
        finally:
            engine.dispose()

    def start(self) -> None:
        # Clients on other addresses are matched by address, never by a reverse DNS lookup
        # (which can stall each new connection where no resolver answers).
        elsewhere = ["--skip-name-resolve"] if self.also_listen else []
        self.process = subprocess.Popen(
            [self.binary, "--no-defaults", f"--datadir={self.data}", f"--port={self.port}",
             f"--bind-address={','.join(['127.0.0.1', *self.also_listen])}",
             f"--socket={self.dir / 'sock'}", f"--max-connections={self.max_connections}",
             f"--pid-file={self.dir / 'pid'}", f"--user={self.user}",
             f"--log-error={self.dir / 'server.log'}", "--innodb-buffer-pool-size=32M",
             "--skip-log-bin", *elsewhere],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(self._answers, 60, f"MariaDB on port {self.port}", interval=0.1)
        engine = create_engine(self.url.rsplit("/", 1)[0] + "/")
        try:
            with engine.begin() as conn:
                conn.execute(text("CREATE DATABASE IF NOT EXISTS test"))
                # An application's user, without READ ONLY ADMIN (root writes on a
                # read-only server): ``app_url``.
                for host in ("localhost", "127.0.0.1", "%"):
                    conn.execute(text(f"CREATE USER IF NOT EXISTS 'app'@'{host}'"))
                    conn.execute(text(f"GRANT ALL PRIVILEGES ON test.* TO 'app'@'{host}'"))
                if self.also_listen:
                    conn.execute(text("CREATE USER IF NOT EXISTS 'root'@'%'"))
                    conn.execute(text("GRANT ALL PRIVILEGES ON *.* TO 'root'@'%' "
                                      "WITH GRANT OPTION"))
        finally:
            engine.dispose()

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(f"mariadbd exited {self.process.returncode}: "
                               + (self.dir / "server.log").read_text(errors="replace")[-2000:])
        return subprocess.run(["mysqladmin", "--no-defaults", "--host=127.0.0.1",
                               f"--port={self.port}", "--user=root", "ping"],
                              check=False, capture_output=True, timeout=30).returncode == 0

    def stop_immediately(self) -> None:
        """The outage: the server SIGKILLed, every session with it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def destroy(self) -> None:
        self.stop_immediately()
        shutil.rmtree(self.dir, ignore_errors=True)


#: The throwaway server of each kind of store (the chaos runs' ``--store``).
STORE_SERVERS: dict[str, type[ThrowawayPostgres] | type[ThrowawayMariaDB]] = {
    "postgresql": ThrowawayPostgres, "mariadb": ThrowawayMariaDB}


def throwaway_store(kind: str, max_connections: int = 100,
                    also_listen: Sequence[str] = ()) -> StoreServer:
    """A throwaway server of one kind of store (a key of ``STORE_SERVERS``), not started."""
    return STORE_SERVERS[kind](max_connections=max_connections, also_listen=also_listen)


class ThrowawayRedis:
    """A ``redis-server`` of its own; ``persistent`` keeps data across a kill (AOF, fsync)."""

    def __init__(self, persistent: bool = False, also_listen: Sequence[str] = ()) -> None:
        self.also_listen = list(also_listen)
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install Redis")
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="resilient-redis-", dir="/tmp"))
        self.port = free_port()
        self.persistent = persistent
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ThrowawayRedis:
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.persistent
                       else ["--appendonly", "no"])
        with (self.dir / "server.log").open("ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 *self.also_listen, "--dir",
                 str(self.dir), "--save", "", "--protected-mode", "no", *persistence],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.answers, 30, f"redis-server on port {self.port}")
        return self

    def url_on(self, host: str) -> str:
        """The URL by one of its other addresses."""
        return self.url.replace("//127.0.0.1:", f"//{host}:")

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server vanishes the hard way."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    stop = kill

    def restart(self) -> ThrowawayRedis:
        self.kill()
        return self.start()

    def destroy(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
