"""One SQLAlchemy engine per process, created on first use and dropped after fork.

A prefork pool child must never reuse the parent's pooled connections, so the engine is keyed
by PID: a forked child builds its own, and the inherited pool is discarded without closing
the parent's sockets.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import weakref
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError, NoSuchModuleError

from celery_resilient.errors import ConfigurationError
from celery_resilient.store import deadlines, packet_limit
from celery_resilient.store.dialect import check_server

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 30_000
WRITE_OPTION = "resilient_write"


def for_writing(conn: Connection) -> Connection:
    """Mark a connection, before its transaction begins, as one that will write.

    On SQLite a writing transaction takes the lock up front (``BEGIN IMMEDIATE``) so it never
    deadlocks upgrading a read lock; a reading one uses a deferred ``BEGIN`` and does not
    queue behind writers (WAL readers never block).
    """
    conn.execution_options(**{WRITE_OPTION: True})  # sets it on this connection in place
    return conn


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(
        url,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "isolation_level": None,
                      "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives process crashes
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        writing = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if writing else "BEGIN")

    return engine


#: MySQL session settings of every store connection (see _mysql_engine).
MYSQL_SESSION = "SET time_zone = '+00:00'"
#: The isolation of a session whose statements autocommit (the engine sets the others').
MYSQL_AUTOCOMMIT_ISOLATION = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"


def utf8mb4_url(url: str) -> URL:
    """``url`` with the character set the store connects with: always ``utf8mb4``. A URL (or
    Django's ``OPTIONS``) naming another (``utf8``/``utf8mb3``, Django's old default;
    ``latin1``) would make a task id, key or ledger key outside it fail the statement, and a
    batch of takes with it; the server converts between the connection's character set and
    each column's, so the user's own tables written in ``ledger.atomic()`` keep theirs.
    Replaced with a warning, once per URL."""
    parsed = make_url(url)
    query = dict(parsed.query)
    given = str(query.get("charset", "utf8mb4"))
    if given.lower() != "utf8mb4":
        with _charset_lock:
            if url not in _charset_warned:
                _charset_warned.add(url)
                log.warning("the store connects with charset utf8mb4, not %s as its URL "
                            "says: task ids, keys and payloads may hold any character",
                            given, extra={"action": "store_charset"})
    query["charset"] = "utf8mb4"
    return parsed.set(query=query)


_charset_warned: set[str] = set()
_charset_lock = threading.Lock()


def _mysql_engine(url: str, autocommit: bool) -> Engine:
    """A MySQL/MariaDB engine (``mysql+pymysql://``, ``mysql+mysqldb://``).

    - ``READ COMMITTED``, not InnoDB's default ``REPEATABLE READ``: every store transaction
      is a few statements that lock the rows they change (fenced writes, takes, ``SKIP
      LOCKED`` sweeps). Under ``REPEATABLE READ`` a locking read or an UPDATE by a
      non-unique index (``state``, ``lease_expires_at``, ``task_id``) also takes gap and
      next-key locks, so two sweepers or a sweep and a receipt deadlock on rows neither
      needs; under ``READ COMMITTED`` only matched rows are locked, and a plain read sees
      the latest commit, as on PostgreSQL (the same snapshot semantics the store's
      statements were written for).
    - no pool pre-ping, as on PostgreSQL: MySQL ends idle sessions after ``wait_timeout``
      (8 h by default; a proxy may drop them sooner), and such a stale connection fails on
      use, before its statement reached the server, so the call runs once more on a fresh
      one (``guarded``). A pre-ping would cost a round trip per checkout and, sent before
      the pool's checkout hook, escape the round-trip deadlines (:mod:`.deadlines`): a
      silent server would hang it. The autocommit engine of the per-task statements also
      sends no rollback when a connection goes back to the pool (a connection that raised
      anything there is dropped instead: ``Database._autocommitted``).
    - ``utf8mb4``, whatever the server's default or the URL says (:func:`utf8mb4_url`).
    - the session time zone is UTC (``MYSQL_SESSION``): the store's clock does not depend
      on it (``Dialect.now`` reads ``UTC_TIMESTAMP(6)``), but any date a statement or an
      operator's query derives from it is then UTC, as on the other dialects.

    ``autocommit``: connections in autocommit for good (single-statement transactions),
    which may also send several statements in one packet (``CLIENT_MULTI_STATEMENTS``): the
    take sends its UPDATE, the read of the row it locked and the COMMIT as one round trip
    (:mod:`.hot_mysql`). Only the store's own statements run there, every value bound.
    """
    engine = create_engine(utf8mb4_url(url),
                           # named placeholders whichever the driver (mysqlclient defaults
                           # to positional ones): the fast paths send their statements on
                           # the driver's cursor with one dict of values, written once
                           paramstyle="pyformat",
                           isolation_level="AUTOCOMMIT" if autocommit else "READ COMMITTED",
                           pool_reset_on_return=None if autocommit else "rollback",
                           pool_size=2 if autocommit else 5,
                           max_overflow=3 if autocommit else 5,
                           connect_args=_mysql_connect_args(url, autocommit))

    if autocommit:
        rollback = engine.dialect.do_rollback

        def do_rollback(dbapi_conn: Any) -> None:
            # SQLAlchemy rolls back every connection it closes; both drivers send that
            # ROLLBACK even in autocommit, a round trip per hot statement for nothing. No
            # transaction is open here: the only ones on these sessions are the take's, and
            # a connection that raised anything inside one is dropped, never returned
            # (``Database._autocommitted``). PyMySQL also tells, from the server's status in
            # its last reply (a local read); mysqlclient keeps that status to itself.
            status = getattr(dbapi_conn, "server_status", None)
            if not isinstance(status, int) or not status & SERVER_STATUS_IN_TRANS:
                return
            rollback(dbapi_conn)

        engine.dialect.do_rollback = do_rollback  # type: ignore[method-assign,assignment]

    if engine.dialect.driver == "mysqldb":
        _rows_one_by_one(engine)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        check_server(engine.dialect)
        cur = dbapi_conn.cursor()
        cur.execute(MYSQL_SESSION)
        if autocommit:  # its single statements lock as the transactions do (no gap locks)
            cur.execute(MYSQL_AUTOCOMMIT_ISOLATION)
        cur.close()

    packet_limit.install(engine)
    return engine


def _rows_one_by_one(engine: Engine) -> None:
    """mysqlclient's ``executemany`` rewrites an ``INSERT ... VALUES (...)`` into one
    multi-row statement but sends what follows the VALUES as written: the placeholders of an
    ``ON DUPLICATE KEY UPDATE`` (the receipts' upsert) would reach the server unfilled. Such
    statements run one row at a time, as PyMySQL runs them."""
    many = engine.dialect.do_executemany

    def do_executemany(cursor: Any, statement: str, parameters: Any, context: Any = None,
                       ) -> None:
        if "ON DUPLICATE KEY UPDATE" not in statement:
            many(cursor, statement, parameters, context)
            return
        rowcount = sum(cursor.execute(statement, row) for row in parameters)
        if context is not None:
            context._rowcount = rowcount

    engine.dialect.do_executemany = do_executemany  # type: ignore[method-assign]


#: MySQL protocol capability flags (the same for PyMySQL and mysqlclient): matched rather
#: than changed rows as an UPDATE's count (SQLAlchemy's MySQL dialects always ask for it),
#: and several statements in one packet.
CLIENT_FOUND_ROWS = 2
CLIENT_MULTI_STATEMENTS = 1 << 16
#: The server-status bit of a reply sent inside a transaction.
SERVER_STATUS_IN_TRANS = 1


def _mysql_connect_args(url: str, autocommit: bool = False) -> dict[str, Any]:
    """Bounds on a connection that stops answering (as PARTITION_TIMEOUTS on PostgreSQL):
    a connect within 5 s; a read or write on the socket within 60 s unless the URL sets
    them. A statement that waits for a row lock longer is ended by the server first
    (``innodb_lock_wait_timeout``, 50 s by default), and retried as transient."""
    parsed = make_url(url)
    args: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 60, "write_timeout": 60}
    args = {k: v for k, v in args.items() if k not in parsed.query}
    if autocommit:  # given here, the flags replace the dialect's: FOUND_ROWS kept
        args["client_flag"] = (int(str(parsed.query.get("client_flag", 0))) | CLIENT_FOUND_ROWS
                               | CLIENT_MULTI_STATEMENTS)
    return args


def build_engine(url: str, autocommit: bool = False) -> Engine:
    """``autocommit``: an engine whose connections stay in autocommit for good, for
    statements that are each their own transaction (take, finish): no isolation level set
    and reset around every statement, no rollback on return to the pool."""
    try:
        backend = make_url(url).get_backend_name()
        if backend == "sqlite":
            return _sqlite_engine(url)
        if backend in ("mysql", "mariadb"):
            engine = _mysql_engine(url, autocommit)
            deadlines.install(engine)
            _keep_interrupts(engine)
            return engine
        if autocommit:
            engine = create_engine(url, pool_size=2, max_overflow=3,
                                   isolation_level="AUTOCOMMIT", pool_reset_on_return=None,
                                   connect_args=_connect_args(url))
        else:
            # No pre-ping: a stale pooled connection is detected on use and retried once
            # (``guarded``).
            engine = create_engine(url, pool_size=5, max_overflow=5,
                                   connect_args=_connect_args(url))
        if make_url(url).get_driver_name() == "psycopg":
            event.listen(engine, "checkout", _refuse_unfinished)
            cooperative_psycopg_waits()
        deadlines.install(engine)
        _keep_interrupts(engine)
        return engine
    except (NoSuchModuleError, ImportError) as exc:
        raise ConfigurationError(
            f"resilient_store_url={sanitize_url(url)!r} names a database driver that is not "
            f"installed or does not exist ({exc}); e.g. install the postgres extra for "
            "postgresql+psycopg://, the mysql extra for mysql+pymysql://, the mysqlclient "
            "extra for mysql+mysqldb://"
        ) from None


#: libpq settings that bound how long a partitioned connection can hang (see _connect_args).
PARTITION_TIMEOUTS: dict[str, int] = {"keepalives": 1, "keepalives_idle": 10,
                                      "keepalives_interval": 5, "keepalives_count": 3,
                                      "tcp_user_timeout": 30_000}


def _connect_args(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return {}
    args: dict[str, Any] = {"connect_timeout": 5}
    # A server that vanishes behind a network partition never answers a statement already
    # sent: without these, the call (and a warm shutdown waiting for that task) hangs until
    # the kernel gives up retransmitting, about 15 minutes. TCP keepalives after 10 s idle,
    # and 30 s at most for sent data to go unacknowledged, end it as a store outage instead.
    # A server that is alive but slow still acknowledges, so a long statement is not cut.
    # Values given in the URL's query win.
    for name, value in PARTITION_TIMEOUTS.items():
        if name not in parsed.query:
            args[name] = value
    if parsed.get_driver_name() == "psycopg":
        # No server-side prepared statements: psycopg would prepare a statement on its fifth
        # run on a connection, and a prepared statement may get a generic plan that does not
        # know the open states are rare (reconcile and the sweep then scan the whole work
        # table: seconds at millions of rows). Without them every plan is a custom plan, and
        # PgBouncer in transaction mode works at any version. benchmarks/store_load.py: the
        # hot path kept 95 % of its throughput.
        args["prepare_threshold"] = None
    return args


class _Swallowed(threading.local):
    interrupt: BaseException | None = None


_swallowed = _Swallowed()


def _keep_interrupts(engine: Engine) -> None:
    """Celery's soft time limit is an ``Exception`` raised from a signal handler wherever the
    pool process is. Landing in the pool's rollback of a returned connection, SQLAlchemy
    logs it ("Exception during reset or similar") and swallows it, so the task went on
    past its limit, unaware. The rollback keeps it for :func:`raise_swallowed_interrupt`."""
    rollback = engine.dialect.do_rollback

    def do_rollback(dbapi_conn: Any) -> None:
        try:
            rollback(dbapi_conn)
        except Exception as exc:
            if type(exc).__module__.startswith("billiard"):
                _swallowed.interrupt = exc
            raise

    engine.dialect.do_rollback = do_rollback  # type: ignore[method-assign,assignment]


def forget_swallowed_interrupt() -> None:
    _swallowed.interrupt = None


def raise_swallowed_interrupt() -> None:
    """Raise the interrupt the pool's rollback met since :func:`forget_swallowed_interrupt`,
    once the connection is back in the pool."""
    exc, _swallowed.interrupt = _swallowed.interrupt, None
    if exc is not None:
        raise exc


def cooperative_psycopg_waits() -> None:
    """Make psycopg wait for the server through ``select`` when eventlet patched it.

    psycopg waits in C (``wait_c``) unless gevent patched ``select``; eventlet it does not
    detect. Under eventlet every round trip then blocks the whole process: each statement
    stops every green thread for its duration, and a store that answers nothing stops them
    for good (the lease renewal, the deadline watchdog that would end the call, the other
    tasks), until the link answers again. psycopg's ``wait_select`` goes through eventlet's
    green ``select`` and lets them run. The connect's own wait already uses ``selectors``,
    which eventlet serves. (The same choice as ``PSYCOPG_WAIT_FUNC=wait_select``.)"""
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is None or not patcher.is_monkey_patched("select"):
        return
    from psycopg import waiting  # noqa: PLC0415 - psycopg is the optional driver

    if waiting.wait is not waiting.wait_select:
        waiting.wait = waiting.wait_select
        log.debug("psycopg waits through eventlet's green select")


def _refuse_unfinished(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
    """Never lend a connection that still waits for a reply or is broken.

    An exception raised from a signal handler (Celery's soft time limit, ``SIGUSR1``) while
    psycopg waited for the server leaves the connection mid-protocol; wherever that happened
    (a statement, a commit, the pool's own reset), it must not serve the next caller. A
    local status read, no round trip; the pool replaces the connection.
    """
    from psycopg import pq  # noqa: PLC0415 - psycopg is the optional driver

    if dbapi_conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise DisconnectionError("connection left mid-statement or broken; replaced")


def _release(engine: Engine, owner_pid: int) -> None:
    """Close an engine's pooled connections, only in the process that opened them."""
    engine.dispose(close=os.getpid() == owner_pid)


class EngineHolder:
    """Lazily built, fork-aware engine for one URL."""

    def __init__(self, url: str, autocommit: bool = False) -> None:
        self.url = url
        self.autocommit = autocommit
        self._engine: Engine | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def get(self) -> Engine:
        pid = os.getpid()
        if self._engine is None or self._pid != pid:
            with self._lock:
                if self._engine is None or self._pid != pid:
                    if self._engine is not None:
                        self._engine.dispose(close=False)  # inherited: leave parent's sockets
                    self._engine = build_engine(self.url, self.autocommit)
                    self._pid = pid
                    # A holder dropped without dispose() (a store that went out of scope)
                    # still closes its connections, instead of leaving them to the GC.
                    weakref.finalize(self, _release, self._engine, pid)
        return self._engine

    def dispose(self) -> None:
        with self._lock:
            if self._engine is not None and self._pid == os.getpid():
                self._engine.dispose()
            self._engine = None


def sanitize_url(url: str) -> str:
    """The URL with its password masked, fit for logs and banners."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)  # user may be empty: redis://:pw@
