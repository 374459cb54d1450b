"""ResumableTask vs plain Celery, procrastinate and DBOS on one PostgreSQL, in one run.

procrastinate and DBOS are the durable-execution peers: both keep their work in PostgreSQL.

Systems (each with two units running at once; only one system's processes alive at a time):

- ``plain``: plain Celery, ``acks_late=True`` tasks, ``celery worker -c 2`` prefork (one main
  process, two pool processes) on Redis; nothing durable but the broker's message.
- ``resumable``: the same worker with ``Resilient(app)`` (every setting at its default, store
  on PostgreSQL) and ``base=ResumableTask``, as the README wires it.
- ``procrastinate`` (3.10): ``procrastinate worker --concurrency 2`` (one asyncio process,
  ``async`` bodies), LISTEN/NOTIFY on (default; polling fallback every 5 s, default), finished
  jobs kept (``delete_jobs`` default ``never``), worker heartbeats (default 10 s) and the
  docs' "Retry stalled jobs" periodic task (see ``peers_procrastinate_app.py``).
- ``dbos`` (3.4): one process, ``DBOS.register_queue(worker_concurrency=2,
  polling_interval_sec=0.01)`` (the queue's default polling interval is 1 s), an
  ``executor_id`` of its own (DBOS's self-hosting docs: needed for worker concurrency and for
  recovery), DBOS's default durability: workflow status and step outputs in PostgreSQL.
- optional ``procrastinate-2p`` / ``dbos-2p``: the same with two processes of concurrency 1,
  so the peers get two interpreters (two GILs) as the prefork pool does.

Workloads, the same number of units for every system: ``trivial`` (2,000), ``sleep`` (10 ms,
2,000), ``progress`` (five durable progress points, 1,000: ResumableTask
``self.checkpoint.save``, DBOS five ``@DBOS.step`` calls; plain Celery and procrastinate have
no checkpoints, so there a point is an autocommitted upsert into a table of the benchmark's).

How it times: the units are made available at once to workers that are already running and
warm, and the clock runs until none is left. Celery: publish to a queue nobody consumes, then
``add_consumer`` (as ``throughput.py``); procrastinate: ``batch_defer`` inside one transaction
(its commit wakes the workers through NOTIFY); DBOS: ``DBOSClient.enqueue_in_transaction``
for every unit in one transaction, then the commit. Drain detection: Redis (queue empty,
nothing unacked) or the peer's job table, every 10 ms. Rounds rotate the systems' order;
each round starts each system's workers afresh and warms them up, untimed.

Statements per unit, in an extra, untimed round (a quarter of the units): with
``pg_stat_statements`` if the server has it loaded (``shared_preload_libraries``), else from
PostgreSQL's own statement log, ``log_statement = 'all'`` set for the run's database only
(``ALTER DATABASE``; the server's configuration is not touched), its lines counted by backend
PID, so the enqueuer's connections are told apart, and transactions counted as COMMIT/ROLLBACK
plus statements run outside BEGIN (``pg_stat_database`` lags up to 10 s behind an idle
backend, too late for a window of a few seconds). CPU: ``/proc`` of the worker processes, of
the run database's PostgreSQL backends and of ``redis-server``.

Recovery: one long unit (8 points of 0.5 s), the workers' process groups SIGKILLed during the
5th point and restarted at once; seconds from the kill until the unit runs again, and the
point it resumed from.

Everything lives in a database of its own (``peers_<tag>``, dropped at the end), Redis
database 10 and queue names carrying the run's tag.

    python benchmarks/peers.py [--reps 3] [--units-scale 1] [--systems plain,resumable,...]
        [--workloads trivial,sleep,progress]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis
from bench_common import HERE, Worker, machine, markdown_table, median, process_cpu, wait_for
from celery import Celery
from peers_units import (
    CREATE_PROGRESS,
    KILL_AT,
    LONG_POINT_S,
    LONG_POINTS,
    WORKLOADS,
    task_name,
)

from celery_resilient.store.sql import Store
from celery_resilient.testing.effects import EffectLog

BASE_UNITS = {"trivial": 2000, "sleep": 2000, "progress": 1000}
DBOS_POLLING_S = 0.01
PG_VERSIONS = {"procrastinate": "3.10.", "dbos": "3.4."}


@dataclass
class System:
    name: str
    label: str
    kind: str  # celery | procrastinate | dbos
    procs: int
    concurrency: int
    config: str
    skip: str | None = None
    rates: dict[str, list[float]] = field(default_factory=dict)
    #: per workload, per round: CPU ms per unit of (worker processes, PG backends, redis-server)
    cpu: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    statements: dict[str, dict[str, Any]] = field(default_factory=dict)
    recovery: dict[str, Any] = field(default_factory=dict)


def systems_catalog() -> dict[str, System]:
    return {
        "plain": System("plain", "plain Celery", "celery", 1, 2,
                        "celery worker -c 2 prefork, Redis broker, acks_late=True, "
                        "reject_on_worker_lost for the recovery unit"),
        "resumable": System("resumable", "ResumableTask", "celery", 1, 2,
                            "celery worker -c 2 prefork, Redis broker, Resilient(app) defaults "
                            "(reliable fetch, 30 s leases, session liveness), PostgreSQL store"),
        "procrastinate": System("procrastinate", "procrastinate", "procrastinate", 1, 2,
                                "1 worker process --concurrency 2, async bodies, LISTEN/NOTIFY "
                                "+ 5 s polling (defaults), heartbeat 10 s, retry-stalled-jobs "
                                "task every 10 s (docs: every 10 min), stalled after 30 s"),
        "procrastinate-2p": System("procrastinate-2p", "procrastinate x2 proc", "procrastinate",
                                   2, 1, "2 worker processes --concurrency 1, otherwise as "
                                   "procrastinate"),
        "dbos": System("dbos", "DBOS", "dbos", 1, 2,
                       f"1 process, register_queue(worker_concurrency=2, polling_interval_sec="
                       f"{DBOS_POLLING_S}) (default polling 1 s), own executor_id, default "
                       "durability (status + step outputs in PostgreSQL)"),
        "dbos-2p": System("dbos-2p", "DBOS x2 proc", "dbos", 2, 1,
                          "2 processes, worker_concurrency=1 each, otherwise as dbos"),
    }


# -- the run's PostgreSQL database and what we read from it -------------------------------------


class Monitor:
    """Our own connection to the run's database: drain checks, counters, backend PIDs.

    Its statements are kept out of the statement log (``SET log_statement``) and counted, so
    they can be taken off ``pg_stat_database`` and ``pg_stat_statements`` totals."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(f"{dsn}?application_name=peers-monitor", autocommit=True)
        self.conn.execute("SET log_statement = 'none'")
        self.pid = self.conn.info.backend_pid
        self.queries = 0

    def scalar(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        self.queries += 1
        row = self.conn.execute(sql, params).fetchone()
        return row[0] if row else None

    def backends(self) -> list[int]:
        self.queries += 1
        rows = self.conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = "
                                 "current_database() AND pid <> pg_backend_pid()").fetchall()
        return [int(r[0]) for r in rows]

    def pgss_calls(self) -> int:
        return int(self.scalar("SELECT coalesce(sum(calls), 0) FROM pg_stat_statements WHERE "
                               "dbid = (SELECT oid FROM pg_database WHERE datname = "
                               "current_database())"))


def server_log_path(monitor: Monitor) -> tuple[Path | None, str]:
    """Where this (local) server writes its log: the collector's file, or the postmaster's
    stderr; (None, why) if it cannot be read from here."""
    try:
        current = monitor.scalar("SELECT pg_current_logfile()")
        data_dir = Path(str(monitor.scalar("SHOW data_directory")))
        if current:
            path = Path(current) if Path(current).is_absolute() else data_dir / current
        else:
            postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
            path = Path(os.readlink(f"/proc/{postmaster}/fd/2"))
        with path.open("rb"):
            pass
        return path, str(path)
    except (OSError, ValueError, psycopg.Error) as exc:
        return None, f"server log not readable from here ({exc})"


class StatementLog:
    """The lines ``log_statement = 'all'`` writes for one database, by byte offset."""

    def __init__(self, path: Path, db: str) -> None:
        self.path = path
        self.line = re.compile(rf"^\S+ \S+ \S+ \[(\d+)\] [^@\s]*@{re.escape(db)} LOG:  "
                               r"(?:statement|execute [^:]+): (.*)$")

    def offset(self) -> int:
        return self.path.stat().st_size

    def read(self, start: int, end: int) -> list[tuple[int, str]]:
        with self.path.open("rb") as fh:
            fh.seek(start)
            text = fh.read(max(0, end - start)).decode(errors="replace")
        found = []
        for line in text.splitlines():
            m = self.line.match(line)
            if m:
                found.append((int(m.group(1)), m.group(2)))
        return found


def kind_of(statement: str) -> str:
    word = (statement.strip().split(None, 1) or [""])[0].upper().rstrip(";")
    if not word:
        return "ping"  # an empty statement: a pool's liveness check (";" or "")
    if word in ("BEGIN", "START", "COMMIT", "END", "ROLLBACK"):
        return "begin/commit"
    if word in ("SELECT", "WITH", "VALUES"):
        return "select"
    if word in ("INSERT", "UPDATE", "DELETE"):
        return "insert/update/delete"
    return "other"


KINDS = ("begin/commit", "select", "insert/update/delete", "ping", "other")


def transactions(lines: list[tuple[int, str]]) -> int:
    """Transactions among logged statements: each COMMIT/ROLLBACK, and each statement a
    session ran outside BEGIN ... COMMIT (autocommit)."""
    open_in: set[int] = set()
    count = 0
    for pid, statement in lines:
        word = (statement.strip().split(None, 1) or [""])[0].upper().rstrip(";")
        if word in ("BEGIN", "START"):
            open_in.add(pid)
        elif word in ("COMMIT", "END", "ROLLBACK"):
            open_in.discard(pid)
            count += 1
        elif pid not in open_in:
            count += 1
    return count


# -- processes ----------------------------------------------------------------------------------


class Process(Worker):
    """bench_common's Worker (own process group, log file, SIGTERM stop) around any command."""

    def __init__(self, name: str, env: dict[str, str], argv: list[str], log_dir: Path) -> None:
        super().__init__(name, env, "", log_dir)
        self.argv = argv


@dataclass
class Run:
    """What every driver shares: the run's tag, database, broker and where logs go."""

    tag: str
    tmp: Path
    dsn: str  # libpq URL of the run's database
    sa_url: str
    broker: str
    redis: redis.Redis[bytes]
    monitor: Monitor
    interval: float = 0.01

    @property
    def store_prefix(self) -> str:
        return f"cr{self.tag}_"


class Driver(ABC):
    """Start, feed, watch and kill one system's worker processes."""

    def __init__(self, run: Run, system: System, effect_log: Path | None = None,
                 suffix: str = "") -> None:
        self.run = run
        self.system = system
        self.effect_log = effect_log
        self.queue = f"peers-{system.name}-{run.tag}{suffix}"
        self.suffix = suffix
        self.procs: list[Worker] = []
        self.starts = 0

    def env(self) -> dict[str, str]:
        return {"PEERS_PG_DSN": self.run.dsn, "PEERS_QUEUE": self.queue,
                "PEERS_APP_NAME": "peers-worker",
                "PEERS_EFFECT_LOG": str(self.effect_log or os.devnull)}

    @abstractmethod
    def start(self) -> None: ...

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.alive():
                assert proc.proc is not None
                os.killpg(proc.proc.pid, signal.SIGKILL)
                proc.proc.wait(timeout=30)

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} died:\n{proc.logs()[-3000:]}")

    def worker_pids(self) -> list[int]:
        return [pid for proc in self.procs for pid in proc.pids()]

    @abstractmethod
    def prepare(self, workload: str, units: list[str]) -> Callable[[], None]:
        """Make ``units`` ready without any worker seeing them; return what releases them."""

    @abstractmethod
    def pending(self) -> int:
        """Units made ready and not finished yet."""

    def after(self) -> None:
        """Undo what the release did, once the units are drained."""
        return None

    def enqueuer_pids(self) -> set[int]:
        return set()

    @abstractmethod
    def send_long(self, unit: str, points: int) -> None: ...

    def finished(self) -> int | None:
        """Units the system itself recorded as done (None: it records nothing)."""
        return None

    def log_name(self, i: int = 0) -> str:
        return f"{self.system.name}{self.suffix}-{i}-start{self.starts}"

    def close(self) -> None:
        """Release the benchmark process's own connections to the system."""
        return None


class CeleryDriver(Driver):
    """``celery worker -c 2`` on an idle queue of its own; ``add_consumer`` releases units."""

    def __init__(self, run: Run, system: System, effect_log: Path | None = None,
                 suffix: str = "", live: bool = False) -> None:
        super().__init__(run, system, effect_log, suffix)
        self.live = live  # the recovery case consumes its queue from the start
        self.node = f"peers-{system.name}-{run.tag}{suffix}"
        self.client = Celery("peers-client", broker=run.broker, set_as_current=False)
        self.baseline = 0
        self.kicks = 0

    def start(self) -> None:
        env = {**self.env(), "PEERS_MODE": self.system.name, "PEERS_BROKER": self.run.broker,
               "PEERS_STORE_URL": self.run.sa_url, "PEERS_TABLE_PREFIX": self.run.store_prefix}
        self.starts += 1
        worker = Worker(self.node, env, self.queue if self.live else f"{self.queue}-idle",
                        self.run.tmp, concurrency=self.system.concurrency,
                        app="peers_celery_app")
        worker.log_path = self.run.tmp / f"{self.log_name()}.log"
        self.procs = [worker.start()]
        wait_for(self.ping, 90, f"{self.system.name} worker to answer", interval=0.2)
        self.baseline = int(self.run.redis.hlen("unacked"))

    def ping(self) -> bool:
        self.check_alive()
        node = [f"{self.node}@{socket.gethostname()}"]
        return bool(self.client.control.ping(destination=node, timeout=0.5))

    def prepare(self, workload: str, units: list[str]) -> Callable[[], None]:
        with self.client.producer_or_acquire() as producer:
            for unit in units:
                self.client.send_task(task_name(workload), args=(unit,), queue=self.queue,
                                      producer=producer)

        def release() -> None:
            node = [f"{self.node}@{socket.gethostname()}"]
            if not self.client.control.add_consumer(self.queue, destination=node, reply=True,
                                                    timeout=10):
                raise RuntimeError(f"{self.node} did not answer add_consumer")
            # The consumer's blocking pop on its idle queue only takes the new queue in when
            # it returns (kombu's brpop_timeout, 1 s): one unit on the idle queue ends it now.
            self.client.send_task(task_name("trivial"), args=("kick",),
                                  queue=f"{self.queue}-idle")
            self.kicks += 1

        return release

    def pending(self) -> int:
        self.check_alive()
        pipe = self.run.redis.pipeline(transaction=False)
        pipe.llen(self.queue)
        pipe.hlen("unacked")
        queued, unacked = pipe.execute()
        return int(queued) + max(0, int(unacked) - self.baseline)

    def after(self) -> None:
        node = [f"{self.node}@{socket.gethostname()}"]
        self.client.control.cancel_consumer(self.queue, destination=node, reply=True,
                                            timeout=10)

    def send_long(self, unit: str, points: int) -> None:
        self.client.send_task(task_name("long"), args=(unit, points), queue=self.queue)

    def finished(self) -> int | None:
        if self.system.name != "resumable":
            return None
        store = Store(self.run.sa_url, self.run.store_prefix)
        try:
            return int(store.count_by_state().get("done", 0)) - self.kicks
        finally:
            store.dispose()


class ProcrastinateDriver(Driver):
    """``procrastinate worker`` processes; one ``batch_defer`` transaction, committed, releases
    the units (the commit delivers the NOTIFY the workers LISTEN for)."""

    def __init__(self, run: Run, system: System, effect_log: Path | None = None,
                 suffix: str = "") -> None:
        super().__init__(run, system, effect_log, suffix)
        import peers_procrastinate_app

        self.app = peers_procrastinate_app.app
        self.enqueuer = psycopg.connect(f"{run.dsn}?application_name=peers-enqueue")

    def start(self) -> None:
        self.starts += 1
        before = int(self.run.monitor.scalar(
            "SELECT coalesce(max(id), 0) FROM procrastinate_workers"))
        self.procs = []
        for i in range(self.system.procs):
            argv = [sys.executable, "-m", "procrastinate", "--app",
                    "peers_procrastinate_app.app", "--log-level", "warning", "worker",
                    "--queues", self.queue, "--concurrency", str(self.system.concurrency),
                    "--name", f"{self.system.name}-{i}"]
            self.procs.append(Process(self.log_name(i), self.env(), argv, self.run.tmp).start())

        def registered() -> bool:
            self.check_alive()
            return int(self.run.monitor.scalar(
                "SELECT count(*) FROM procrastinate_workers WHERE id > %s",
                (before,))) >= self.system.procs

        wait_for(registered, 90, f"{self.system.name} workers to register", interval=0.1)

    def prepare(self, workload: str, units: list[str]) -> Callable[[], None]:
        task = self.app.tasks[task_name(workload)]
        kwargs: list[dict[str, Any]] = [{"unit": unit} for unit in units]
        task.configure(queue=self.queue, connection=self.enqueuer).batch_defer(*kwargs)
        return self.enqueuer.commit

    def pending(self) -> int:
        self.check_alive()
        return int(self.run.monitor.scalar(
            "SELECT count(*) FROM procrastinate_jobs WHERE queue_name = %s AND status IN "
            "('todo', 'doing') AND task_name LIKE 'peers.%%' AND task_name <> "
            "'peers.retry_stalled_jobs'", (self.queue,)))

    def enqueuer_pids(self) -> set[int]:
        return {self.enqueuer.info.backend_pid}

    def close(self) -> None:
        self.enqueuer.close()

    def send_long(self, unit: str, points: int) -> None:
        self.app.tasks[task_name("long")].configure(
            queue=self.queue, connection=self.enqueuer).defer(unit=unit, points=points)
        self.enqueuer.commit()

    def finished(self) -> int | None:
        return int(self.run.monitor.scalar(
            "SELECT count(*) FROM procrastinate_jobs WHERE queue_name = %s AND status = "
            "'succeeded' AND task_name IN ('peers.trivial', 'peers.sleep', 'peers.progress')",
            (self.queue,)))


class DbosDriver(Driver):
    """``peers_dbos_app.py`` processes; ``enqueue_in_transaction`` for every unit in one
    transaction, committed, releases them (the queue's next poll, within 10 ms, sees them)."""

    def __init__(self, run: Run, system: System, effect_log: Path | None = None,
                 suffix: str = "") -> None:
        super().__init__(run, system, effect_log, suffix)
        import sqlalchemy

        self.app_name = f"peers-{run.tag}"
        self.engine = sqlalchemy.create_engine(
            run.sa_url, connect_args={"application_name": "peers-enqueue"}, pool_size=1)
        self.client: Any = None
        self.enqueue_pid: int | None = None

    def start(self) -> None:
        self.starts += 1
        self.procs = []
        for i in range(self.system.procs):  # one at a time: the first launch migrates
            env = {**self.env(), "PEERS_APP": self.app_name,
                   "PEERS_EXECUTOR_ID": f"{self.system.name}-{i}",
                   "PEERS_WORKER_CONCURRENCY": str(self.system.concurrency),
                   "PEERS_POLLING_S": str(DBOS_POLLING_S)}
            proc = Process(self.log_name(i), env,
                           [sys.executable, str(HERE / "peers_dbos_app.py")], self.run.tmp)
            self.procs.append(proc.start())

            def ready(proc: Process = proc) -> bool:
                self.check_alive()
                return "PEERS-READY" in proc.logs()

            wait_for(ready, 90, f"{proc.name} to launch", interval=0.1)
        if self.client is None:
            from dbos import DBOSClient

            self.client = DBOSClient(system_database_url=self.run.dsn,
                                     application_name=self.app_name)

    def prepare(self, workload: str, units: list[str]) -> Callable[[], None]:
        conn = self.engine.connect()
        self.enqueue_pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore
        trans = conn.begin()
        options = {"workflow_name": task_name(workload), "queue_name": self.queue}
        for unit in units:
            self.client.enqueue_in_transaction(conn, options, unit)

        def release() -> None:
            trans.commit()
            conn.close()

        return release

    def pending(self) -> int:
        self.check_alive()
        return int(self.run.monitor.scalar(
            "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = %s AND status IN "
            "('ENQUEUED', 'PENDING')", (self.queue,)))

    def enqueuer_pids(self) -> set[int]:
        return {self.enqueue_pid} if self.enqueue_pid else set()

    def send_long(self, unit: str, points: int) -> None:
        self.client.enqueue({"workflow_name": task_name("long"), "queue_name": self.queue},
                            unit, points)

    def finished(self) -> int | None:
        return int(self.run.monitor.scalar(
            "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = %s AND status = "
            "'SUCCESS' AND name IN ('peers.trivial', 'peers.sleep', 'peers.progress')",
            (self.queue,)))

    def close(self) -> None:
        if self.client is not None:
            self.client.destroy()
        self.engine.dispose()


def make_driver(run: Run, system: System, effect_log: Path | None = None,
                suffix: str = "", live: bool = False) -> Driver:
    if system.kind == "celery":
        return CeleryDriver(run, system, effect_log, suffix, live=live)
    if system.kind == "procrastinate":
        return ProcrastinateDriver(run, system, effect_log, suffix)
    return DbosDriver(run, system, effect_log, suffix)


# -- measuring ----------------------------------------------------------------------------------


@dataclass
class Sample:
    seconds: float
    cpu: tuple[float, float, float]  # ms per unit: workers, PG backends, redis-server


def cpu_of(pids: list[int]) -> dict[int, float]:
    return {pid: process_cpu(pid) for pid in pids}


def drain(run: Run, driver: Driver, workload: str, units: list[str],
          hooks: dict[str, Callable[[], None]] | None = None,
          timeout: float | None = None) -> Sample:
    """Release ``units`` to the running workers and time them until none is left."""
    hooks = hooks or {}
    release = driver.prepare(workload, units)
    hooks.get("prepared", lambda: None)()
    redis_pid = int(run.redis.info("server")["process_id"])
    workers0 = cpu_of(driver.worker_pids())
    backends0 = cpu_of(run.monitor.backends())
    redis0 = process_cpu(redis_pid)
    t0 = time.perf_counter()
    release()
    wait_for(lambda: driver.pending() == 0, timeout or 120 + len(units) / 5,
             f"{driver.system.name} to drain {len(units)} {workload} units", run.interval)
    seconds = time.perf_counter() - t0
    hooks.get("drained", lambda: None)()
    workers1 = cpu_of(driver.worker_pids())
    backends1 = cpu_of(run.monitor.backends())
    n = len(units)
    cpu = (sum(v - workers0.get(p, 0.0) for p, v in workers1.items()) * 1000 / n,
           sum(v - backends0.get(p, 0.0) for p, v in backends1.items()) * 1000 / n,
           (process_cpu(redis_pid) - redis0) * 1000 / n)
    driver.after()
    return Sample(seconds, cpu)


def unit_names(system: System, label: str, workload: str, n: int) -> list[str]:
    return [f"{system.name}-{label}-{workload}-{i}" for i in range(n)]


def preflight(run: Run, system: System) -> None:
    """Start the system and run a few units; if it cannot run here, say why and skip it."""
    driver = make_driver(run, system, suffix="p")
    try:
        driver.start()
        drain(run, driver, "trivial", unit_names(system, "p", "trivial", 5), timeout=60)
    except Exception as exc:
        logs = "".join(proc.logs()[-1500:] for proc in driver.procs)
        system.skip = f"could not run here: {exc}".splitlines()[0] + (
            f"; worker log tail: {logs.strip().splitlines()[-1]}" if logs.strip() else "")
        print(f"SKIPPING {system.label}: {system.skip}", flush=True)
    finally:
        driver.stop()
        driver.close()


def throughput_rounds(run: Run, systems: list[System], workloads: list[str],
                      units: dict[str, int], reps: int, warmup: int) -> dict[str, int]:
    """Every round: each system in a rotated order, its workers started, warmed up, timed on
    every workload, stopped. Returns the units each system was sent (for the final check)."""
    sent: dict[str, int] = Counter()
    drivers = {s.name: make_driver(run, s) for s in systems}
    before = {name: driver.finished() for name, driver in drivers.items()}  # the preflight's
    try:
        for rep in range(reps):
            order = systems[rep % len(systems):] + systems[:rep % len(systems)]
            for system in order:
                driver = drivers[system.name]
                driver.start()
                try:
                    drain(run, driver, "trivial", unit_names(system, f"w{rep}", "trivial",
                                                             warmup))
                    sent[system.name] += warmup
                    shift = rep % len(workloads)
                    for workload in workloads[shift:] + workloads[:shift]:
                        n = units[workload]
                        sample = drain(run, driver, workload,
                                       unit_names(system, f"r{rep}", workload, n))
                        sent[system.name] += n
                        system.rates.setdefault(workload, []).append(n / sample.seconds)
                        system.cpu.setdefault(workload, []).append(sample.cpu)
                finally:
                    driver.stop()
            print(f"round {rep + 1}/{reps}: " + "; ".join(
                f"{s.name} " + " ".join(f"{w} {s.rates[w][-1]:.0f}/s" for w in workloads)
                for s in systems), flush=True)
        for system in systems:
            done = drivers[system.name].finished()
            if done is not None and done - (before[system.name] or 0) != sent[system.name]:
                raise RuntimeError(f"{system.name}: {done} units recorded done, "
                                   f"{sent[system.name]} sent")
    finally:
        for driver in drivers.values():
            driver.stop()
            driver.close()
    return sent


@dataclass
class Counting:
    """How statements are counted: the server's statement log (by backend PID, so the
    enqueue is told apart and transactions can be counted), pg_stat_statements (statements of
    the whole database only), or neither (then nothing is counted)."""

    log: StatementLog | None
    pgss: bool
    method: str

    @property
    def possible(self) -> bool:
        return self.log is not None or self.pgss

    def mark(self, run: Run) -> tuple[int, int, int]:
        """(log offset, pg_stat_statements calls, our monitor's statements so far)."""
        return (self.log.offset() if self.log else 0,
                run.monitor.pgss_calls() if self.pgss else 0, run.monitor.queries)

    def measure(self, run: Run, driver: Driver, workload: str,
                units: list[str]) -> dict[str, Any]:
        """Per unit: statements of the workers and of the enqueue, transactions, by kind."""
        marks = {"start": self.mark(run)}
        drain(run, driver, workload, units,
              {"prepared": lambda: marks.update(prepared=self.mark(run)),
               "drained": lambda: marks.update(end=self.mark(run))})
        s, p, e = marks["start"], marks["prepared"], marks["end"]
        n = len(units)
        if self.log is not None:
            enqueuers = driver.enqueuer_pids()
            enqueued = [x for x in self.log.read(s[0], p[0]) if x[0] in enqueuers]
            worked = [x for x in self.log.read(p[0], e[0]) if x[0] not in enqueuers]
            kinds = Counter(kind_of(stmt) for _, stmt in worked)
            return {"worker": len(worked) / n, "enqueue": len(enqueued) / n,
                    "transactions": transactions(worked) / n,
                    "kinds": {k: kinds[k] / n for k in KINDS}}
        # every statement of the database while the units ran, our monitor's taken off; the
        # enqueue cannot be told apart from the workers' idle polling, nor transactions counted
        return {"worker": (e[1] - p[1] - (e[2] - p[2])) / n, "enqueue": None,
                "transactions": None, "kinds": {}}


def counting_method(monitor: Monitor, db: str) -> Counting:
    """pg_stat_statements if the server has it loaded, else the server's statement log."""
    try:
        monitor.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        monitor.scalar("SELECT count(*) FROM pg_stat_statements")
        return Counting(None, True, "pg_stat_statements: calls in the run's database while "
                                    "the units ran, our monitor's taken off (empty pool pings "
                                    "not tracked; enqueue and transactions not attributable)")
    except psycopg.Error as exc:
        why = str(exc).splitlines()[0]
    path, where = server_log_path(monitor)
    if path is None:
        return Counting(None, False, f"nothing: pg_stat_statements unusable ({why}) and "
                                     f"{where}")
    return Counting(StatementLog(path, db), False,
                    f"statement log: pg_stat_statements unusable ({why}), so log_statement="
                    f"'all' for database {db} only, lines of {where} counted per backend PID; "
                    "BEGIN/COMMIT and pool pings count as statements, transactions = "
                    "COMMIT/ROLLBACK + statements outside BEGIN")


def count_round(run: Run, admin: psycopg.Connection[Any], db: str, systems: list[System],
                workloads: list[str], units: dict[str, int], warmup: int,
                counting: Counting) -> None:
    """An untimed round that counts the statements and transactions of every unit."""
    for system in systems:
        if counting.log is not None:
            admin.execute(f'ALTER DATABASE "{db}" SET log_statement = \'all\'')
        driver = make_driver(run, system, suffix="c")
        try:
            driver.start()
            drain(run, driver, "trivial", unit_names(system, "cw", "trivial", warmup))
            for workload in workloads:
                system.statements[workload] = counting.measure(
                    run, driver, workload, unit_names(system, "c", workload, units[workload]))
        finally:
            driver.stop()
            if counting.log is not None:
                admin.execute(f'ALTER DATABASE "{db}" RESET log_statement')
            driver.close()
        print(f"counted {system.name}: " + ", ".join(
            f"{w} {system.statements[w].get('worker', float('nan')):.1f} stmts/unit"
            for w in workloads), flush=True)


def recovery_case(run: Run, system: System, cap: float) -> None:
    """SIGKILL the process groups during point KILL_AT of a long unit, restart at once."""
    effects = EffectLog(run.tmp / f"effects-{system.name}.jsonl")
    driver = make_driver(run, system, effects.path, suffix="k", live=True)

    def times(name: str) -> list[float]:
        return [float(e["at"]) for e in effects.entries(name)]

    def begins() -> list[tuple[float, int]]:
        return [(float(e["at"]), int(e["effect"].split(":")[1])) for e in effects.entries()
                if e["effect"].startswith("begin:")]

    try:
        driver.start()
        driver.send_long(f"{system.name}-long", LONG_POINTS)
        wait_for(lambda: any(p == KILL_AT for _, p in begins()), 60,
                 f"{system.name} long unit to reach point {KILL_AT}", 0.02)
        time.sleep(LONG_POINT_S / 2)
        driver.kill()
        killed = time.time()
        driver.start()
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            if len(times("start")) >= 2 and times("end"):
                break
            time.sleep(0.05)
        starts, ends = times("start"), times("end")
        again = starts[1] - killed if len(starts) >= 2 else None
        after = [p for t, p in begins() if len(starts) >= 2 and t >= starts[1]]
        system.recovery = {
            "running_again_s": round(again, 2) if again is not None else None,
            "finished_s": round(ends[0] - killed, 2) if ends else None,
            "resumed_from_point": (after[0] - 1) if after else None,
            "last_durable_point": KILL_AT - 1,
            "points_redone": sum(1 for p in after if p < KILL_AT),
            "cap_s": cap,
        }
    finally:
        driver.kill()
        driver.close()
    print(f"recovery {system.name}: {system.recovery}", flush=True)


# -- report -------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def throughput_table(systems: list[System], workloads: list[str]) -> str:
    ours = next((s for s in systems if s.name == "resumable"), None)
    rows = []
    for workload in workloads:
        for system in systems:
            rates = system.rates.get(workload)
            if not rates:
                continue
            ratio = paired = "-"
            if ours is not None and ours.rates.get(workload) and system is not ours:
                ratio = f"{median(ours.rates[workload]) / median(rates):.2f}"
                pairs = zip(ours.rates[workload], rates, strict=True)
                paired = f"{median([a / b for a, b in pairs]):.2f}"
            cpu = system.cpu[workload]
            rows.append((workload, system.label, f"{median(rates):.0f}",
                         f"{min(rates):.0f}-{max(rates):.0f}", ratio, paired,
                         *(f"{median([c[i] for c in cpu]):.2f}" for i in range(3))))
    return markdown_table(["workload", "system", "median units/s", "range",
                           "ResumableTask / this (medians)", "(median of per-round pairs)",
                           "CPU ms/unit: workers", "PG backends", "redis-server"], rows)


def ratio_matrix(systems: list[System], workloads: list[str]) -> str:
    ours = next((s for s in systems if s.name == "resumable"), None)
    others = [s for s in systems if s is not ours]
    if ours is None or not others:
        return ""
    rows = [(w, *(f"{median(ours.rates[w]) / median(s.rates[w]):.2f}"
                  if s.rates.get(w) and ours.rates.get(w) else "-" for s in others))
            for w in workloads]
    return markdown_table(["workload", *(f"ResumableTask / {s.label}" for s in others)], rows)


def statements_table(systems: list[System], workloads: list[str]) -> str:
    rows = []
    for workload in workloads:
        for system in systems:
            st = system.statements.get(workload)
            if not st:
                continue
            kinds = st.get("kinds") or {}
            rows.append((workload, system.label, fmt(st.get("worker")), fmt(st.get("enqueue")),
                         fmt(st.get("transactions")),
                         *(fmt(kinds.get(k)) for k in KINDS)))
    return markdown_table(["workload", "system", "statements/unit (workers)",
                           "enqueue statements/unit", "transactions/unit (workers)",
                           *KINDS], rows)


def recovery_table(systems: list[System]) -> str:
    rows = []
    for s in systems:
        r = s.recovery
        if not r:
            continue
        again = (f"{r['running_again_s']:.1f} s" if r["running_again_s"] is not None
                 else f"not within {r['cap_s']:.0f} s")
        resumed = r["resumed_from_point"]
        rows.append((s.label, again,
                     f"{r['finished_s']:.1f} s" if r["finished_s"] is not None else "-",
                     "-" if resumed is None else
                     f"{'yes' if resumed == r['last_durable_point'] else 'no'} (from point "
                     f"{resumed} of {LONG_POINTS}; last durable {r['last_durable_point']})",
                     "-" if resumed is None else str(r["points_redone"])))
    return markdown_table(["system", "unit running again after the kill",
                           "unit finished after the kill", "resumed from its last progress point",
                           "points redone"], rows)


def versions(monitor: Monitor, r: redis.Redis[bytes]) -> dict[str, str]:
    out = {}
    for dist in ("celery", "kombu", "celery-resilient", "procrastinate", "dbos", "psycopg",
                 "sqlalchemy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["postgresql"] = str(monitor.scalar("SHOW server_version")).split()[0]
    out["redis"] = str(r.info("server").get("redis_version", "?"))
    return out


def peer_problem(kind: str) -> str | None:
    """Why a peer cannot run here (not installed, wrong version), or None."""
    if kind not in PG_VERSIONS:
        return None
    try:
        __import__(kind)
        version = importlib.metadata.version(kind)
    except Exception as exc:
        return (f"{kind} not importable ({exc}); install it with "
                f"`python -m pip install --group peers`")
    if not version.startswith(PG_VERSIONS[kind]):
        return f"{kind} {version} installed, the benchmark is written for {PG_VERSIONS[kind]}x"
    return None


def clean_redis(r: redis.Redis[bytes], tag: str) -> None:
    """Our queues, bindings and unacked messages (a killed plain unit stays there)."""
    for key in r.scan_iter(f"*{tag}*"):
        r.delete(key)
    for delivery_tag, raw in r.hscan_iter("unacked"):
        if tag.encode() in raw:
            r.hdel("unacked", delivery_tag)
            r.zrem("unacked_index", delivery_tag)


@dataclass
class Plan:
    """What the options ask for."""

    selected: list[System]
    workloads: list[str]
    units: dict[str, int]
    count_units: dict[str, int]
    warmup: int

    @property
    def systems(self) -> list[System]:
        """The selected systems that can run here."""
        return [s for s in self.selected if s.skip is None]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Plan]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed rounds of every system")
    parser.add_argument("--units-scale", type=float, default=1.0,
                        help="factor on the units per workload (2000/2000/1000), e.g. 0.1")
    parser.add_argument("--systems", default="plain,resumable,procrastinate,dbos",
                        help="comma list of " + ", ".join(systems_catalog()))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=100, help="untimed units per start")
    parser.add_argument("--count-scale", type=float, default=0.25,
                        help="units of the statement-counting round, as a share of the timed")
    parser.add_argument("--recovery-cap", type=float, default=60.0,
                        help="seconds to wait for a killed unit to run and finish again")
    parser.add_argument("--skip-count", action="store_true")
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/test",
                        help="libpq URL of a database on the server (the run creates its own)")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/10")
    args = parser.parse_args(argv)
    catalog = systems_catalog()
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    wrong = [n for n in names if n not in catalog] + [w for w in workloads if w not in WORKLOADS]
    if wrong:
        parser.error(f"unknown system or workload: {', '.join(wrong)}")
    selected = [catalog[n] for n in names]
    for system in selected:
        system.skip = peer_problem(system.kind)
    units = {w: max(10, round(BASE_UNITS[w] * args.units_scale)) for w in workloads}
    return args, Plan(selected, workloads, units,
                      {w: max(20, round(n * args.count_scale)) for w, n in units.items()},
                      max(10, round(args.warmup * min(1.0, args.units_scale * 2))))


def print_header(run: Run, plan: Plan, args: argparse.Namespace, counting: Counting,
                 vers: dict[str, str], started: dt.datetime) -> None:
    print(f"date: {started:%Y-%m-%d %H:%M} UTC; machine: {machine()}; load average at "
          "start " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    print(f"units per timed round: {plan.units} (scale {args.units_scale}); {args.reps} rounds; "
          f"{plan.warmup} warm-up units per start; database peers_{run.tag}, broker "
          f"{args.broker}; each unit's drain checked every {run.interval * 1000:.0f} ms")
    for system in plan.selected:
        print(f"- {system.label}: " + (system.config if system.skip is None
                                       else f"SKIPPED: {system.skip}"))
    print(f"statements counted by: {counting.method}\n", flush=True)


def print_report(plan: Plan, args: argparse.Namespace, counting: Counting) -> None:
    systems, workloads = plan.systems, plan.workloads
    print("\nload average at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print("\n### Throughput (units/s, median of rounds; CPU ms per unit, medians)\n")
    print(throughput_table(systems, workloads))
    print("\n### ResumableTask / each other system (ratio of median units/s)\n")
    print(ratio_matrix(systems, workloads))
    if not args.skip_count and not counting.possible:
        print(f"\nstatements not counted: {counting.method}")
    elif not args.skip_count:
        print(f"\n### PostgreSQL statements per unit ({plan.count_units} units; "
              f"{counting.method})\n")
        print(statements_table(systems, workloads))
        print("\nplain Celery and procrastinate have no checkpoint API: their progress points "
              "are autocommitted upserts into the benchmark's own table (1 statement each); "
              "ResumableTask saves checkpoints, DBOS records step outputs. Worker statements "
              "include what the system does while the units run (polls, heartbeats).")
    if not args.skip_recovery:
        print(f"\n### SIGKILL recovery (one unit of {LONG_POINTS} points x {LONG_POINT_S} s, "
              f"killed during point {KILL_AT}, restarted at once)\n")
        print(recovery_table(systems))
    for system in plan.selected:
        if system.skip:
            print(f"\nskipped {system.label}: {system.skip}")


def summary(plan: Plan, args: argparse.Namespace, counting: Counting, vers: dict[str, str],
            started: dt.datetime) -> dict[str, Any]:
    systems, workloads = plan.systems, plan.workloads
    ours = next((s for s in systems if s.name == "resumable"), None)

    def cpu(s: System, w: str) -> dict[str, float]:
        return {k: round(median([c[i] for c in s.cpu[w]]), 3)
                for i, k in enumerate(("workers", "pg_backends", "redis"))}

    return {
        "date": started.isoformat(timespec="seconds"), "units_scale": args.units_scale,
        "reps": args.reps, "units": plan.units, "machine": machine(), "versions": vers,
        "statement_method": counting.method,
        "systems": {s.name: s.config for s in systems},
        "skipped": {s.name: s.skip for s in plan.selected if s.skip},
        "throughput": {w: {s.name: {"median": round(median(s.rates[w]), 1),
                                    "rates": [round(x, 1) for x in s.rates[w]],
                                    "cpu_ms_per_unit": cpu(s, w)}
                           for s in systems if s.rates.get(w)} for w in workloads},
        "ratio_resumable_over": {
            w: {s.name: round(median(ours.rates[w]) / median(s.rates[w]), 3)
                for s in systems if s is not ours and s.rates.get(w) and ours.rates.get(w)}
            for w in workloads} if ours else {},
        "statements_per_unit": {w: {s.name: s.statements[w] for s in systems
                                    if w in s.statements} for w in workloads},
        "recovery": {s.name: s.recovery for s in systems if s.recovery},
    }


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    tag = uuid.uuid4().hex[:8]
    db = f"peers_{tag}"
    dsn = f"{args.pg_url.rsplit('/', 1)[0]}/{db}"
    sa_url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    os.environ["PEERS_PG_DSN"] = dsn  # peers_procrastinate_app's connector, imported here
    admin = psycopg.connect(args.pg_url, autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    tmp = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    r = redis.Redis.from_url(args.broker)
    started = dt.datetime.now(dt.timezone.utc)
    monitor: Monitor | None = None
    try:
        monitor = Monitor(dsn)
        monitor.conn.execute(CREATE_PROGRESS)
        counting = counting_method(monitor, db)
        run = Run(tag, tmp, dsn, sa_url, args.broker, r, monitor)
        if any(s.name == "resumable" for s in plan.systems):
            store = Store(sa_url, run.store_prefix)
            store.migrate()
            store.dispose()
        if any(s.kind == "procrastinate" for s in plan.systems):
            import peers_procrastinate_app

            with peers_procrastinate_app.app.open():
                peers_procrastinate_app.app.schema_manager.apply_schema()
        vers = versions(monitor, r)
        for system in plan.systems:
            preflight(run, system)
        print_header(run, plan, args, counting, vers, started)
        throughput_rounds(run, plan.systems, plan.workloads, plan.units, args.reps,
                          plan.warmup)
        if not args.skip_count and counting.possible:
            count_round(run, admin, db, plan.systems, plan.workloads, plan.count_units,
                        plan.warmup, counting)
        if not args.skip_recovery:
            for system in plan.systems:
                recovery_case(run, system, args.recovery_cap)
    finally:
        if monitor is not None:
            monitor.conn.close()
        admin.execute(f'ALTER DATABASE "{db}" RESET log_statement')
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        admin.close()
        clean_redis(r, tag)
    print_report(plan, args, counting)
    print("\nPEERS-SUMMARY " + json.dumps(summary(plan, args, counting, vers, started),
                                         sort_keys=True))
    shutil.rmtree(tmp, ignore_errors=True)  # the workers' logs; kept when the run failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
