"""Which database errors are transient: the same work succeeds when it runs again later.

A transient error is never a task's failure. The store turns it into
:class:`~celery_resilient.errors.StoreUnavailable` (the task is re-sent and resumes from its
last checkpoint), after re-running the transaction in place when that is safe.

PostgreSQL, by SQLSTATE (``exc.orig.sqlstate`` on psycopg 3, ``pgcode`` on psycopg2):

- ``40001`` serialization failure and ``40P01`` deadlock detected: the server picked this
  transaction as the loser of a conflict with a concurrent one and rolled it back. Nothing of
  it was written; run alone again, it succeeds. (*Retryable*: re-run in place.)
- ``55P03`` lock not available: ``lock_timeout`` ran out waiting for a row another transaction
  holds; it rolled back, and the lock is released when the holder ends. (*Retryable*.)
- ``57P01`` admin shutdown (``pg_terminate_backend``, a fast shutdown), ``57P02`` crash
  shutdown, ``57P03`` cannot connect now (starting up, in recovery): the backend went away;
  its open transaction is rolled back and a new connection works once the server is back.
- ``25P03`` idle-in-transaction session timeout: the server closed a session that sat too long
  in an open transaction, rolling it back; a fresh session is fine.
- ``25006`` read-only SQL transaction: the connection reached a server that does not take
  writes now (a hot standby, or the old primary while a failover promotes another); nothing was
  written, and a fresh connection reaches the writable primary once it is there.
- class ``08`` connection exceptions, and any error SQLAlchemy flagged ``connection_invalidated``
  (the socket dropped mid-transaction): the transaction never committed, unless the drop came
  during COMMIT, where the outcome is unknown (``Store.begin`` never re-runs that).

SQLite: ``SQLITE_BUSY`` ("database is locked": another connection held the write lock past the
busy timeout) and ``SQLITE_LOCKED`` ("database table is locked"): the statement did not run and
the lock is released when the other writer commits. (*Retryable*.)

MySQL and MariaDB, by error number (``exc.orig.args[0]``):

- ``1213`` deadlock found: InnoDB rolled the whole transaction back. (*Retryable*.)
- ``1205`` lock wait timeout: ``innodb_lock_wait_timeout`` ran out; InnoDB rolls back the
  statement only, and the store then rolls back the rest before it runs the transaction
  again. (*Retryable*.)
- ``2006``/``2013`` server gone, connection lost; ``1053`` server shutdown; ``1927``
  connection killed (MariaDB); ``4031`` disconnected for inactivity (MySQL); ``2002``/``2003``
  cannot connect; ``1290``/``1792`` read-only server or transaction (a replica, or a failover
  under way): the session or its writes are gone; a fresh connection works once the server
  takes writes again.

Everything else (an ``IntegrityError`` of the user's own table, a syntax error, a bug) is not
transient: it would fail the same way again, so it stays the task's failure.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import DBAPIError

#: Rolled back by the server, which says so: re-running the whole transaction is safe.
RETRYABLE_SQLSTATES = {
    "40001": "serialization failure",
    "40P01": "deadlock detected",
    "55P03": "lock not available",
}
#: The session or the server went away; its open transaction was rolled back.
LOST_SQLSTATES = {
    "57P01": "backend terminated by administrator",
    "57P02": "crash shutdown",
    "57P03": "server cannot accept connections now",
    "25P03": "idle-in-transaction session timeout",
    "25006": "read-only transaction (a standby, or a failover under way)",
}
MYSQL_RETRYABLE = {1213: "deadlock found", 1205: "lock wait timeout"}
MYSQL_LOST = {
    2006: "server has gone away", 2013: "lost connection during query",
    1053: "server shutdown in progress", 1927: "connection killed",
    4031: "disconnected by the server for inactivity", 2002: "cannot connect",
    2003: "cannot connect", 1290: "server is read-only", 1792: "read-only transaction",
}
SQLITE_RETRYABLE = ("SQLITE_BUSY", "SQLITE_LOCKED")
SQLITE_MESSAGES = ("database is locked", "database table is locked", "database schema is locked")


def driver_error(exc: BaseException) -> BaseException:
    """The DB-API exception under a SQLAlchemy wrapper (or ``exc`` itself when raw)."""
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    return orig if isinstance(orig, BaseException) else exc


def sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE of ``exc`` (wrapped or raw), or None."""
    orig = driver_error(exc)
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return code if isinstance(code, str) else None


def mysql_errno(exc: BaseException) -> int | None:
    """The MySQL/MariaDB error number of ``exc`` (wrapped or raw), or None."""
    orig = driver_error(exc)
    if not type(orig).__module__.startswith(("pymysql", "MySQLdb")):
        return None
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _sqlite_busy(exc: BaseException) -> str | None:
    orig = driver_error(exc)
    name = getattr(orig, "sqlite_errorname", None)
    if isinstance(name, str) and name.startswith(SQLITE_RETRYABLE):
        return name
    if type(orig).__module__ == "sqlite3" and any(m in str(orig) for m in SQLITE_MESSAGES):
        return "SQLITE_BUSY"
    return None


def is_retryable(exc: BaseException) -> bool:
    """The server rolled the transaction back and said so: run it again in place."""
    return (sqlstate(exc) in RETRYABLE_SQLSTATES or _sqlite_busy(exc) is not None
            or mysql_errno(exc) in MYSQL_RETRYABLE)


def is_transient(exc: BaseException) -> bool:
    """Running the same work again later can succeed: a store outage, not a failure."""
    return is_retryable(exc) or is_lost(exc)


def is_lost(exc: BaseException) -> bool:
    """The connection is gone (or the server refuses writes: a standby), not a conflict the
    server answered with: the store is unreachable until it is back."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if mysql_errno(exc) in MYSQL_LOST:
        return True
    code = sqlstate(exc)
    return code is not None and (code in LOST_SQLSTATES or code.startswith("08"))


def describe(exc: BaseException) -> str:
    """A short name for the error, with its SQLSTATE: ``deadlock detected (SQLSTATE 40P01)``;
    a MySQL error by its number (its SQLSTATEs are coarser: a deadlock is ``40001``, a lock
    wait timeout ``HY000``)."""
    errno = mysql_errno(exc)
    if errno is not None and (errno in MYSQL_RETRYABLE or errno in MYSQL_LOST):
        return f"{MYSQL_RETRYABLE.get(errno) or MYSQL_LOST[errno]} (MySQL error {errno})"
    code = sqlstate(exc)
    if code is not None:
        name = RETRYABLE_SQLSTATES.get(code) or LOST_SQLSTATES.get(code) or (
            "connection exception" if code.startswith("08") else "database error")
        return f"{name} (SQLSTATE {code})"
    busy = _sqlite_busy(exc)
    if busy is not None:
        return busy
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return "connection lost"
    return type(driver_error(exc)).__name__


#: In-place re-runs of a retryable transaction before it counts as a store outage.
RETRIES = 3
BACKOFF_SECONDS = 0.05


def pause(attempt: int) -> None:
    """Wait before re-run ``attempt`` (1-based): 50 ms doubling, jittered so that the two
    losers of one conflict do not collide again."""
    time.sleep(BACKOFF_SECONDS * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))


class _Calls(threading.local):
    """Per thread: the outermost store operation running, and how many commits it made."""

    operation: str | None = None
    commits = 0


_calls = _Calls()


@contextmanager
def operation(name: str) -> Iterator[None]:
    """Name the store operation this thread runs (the outermost one wins), for messages."""
    outer = enter_operation(name)
    try:
        yield
    finally:
        leave_operation(outer)


def enter_operation(name: str) -> str | None:
    """:func:`operation` for the guard, without a context manager (on every store call):
    the outer operation's name, None if this one is the outermost; pass it to
    :func:`leave_operation`."""
    outer = _calls.operation
    if outer is None:
        _calls.operation = name
    return outer


def leave_operation(outer: str | None) -> None:
    _calls.operation = outer


def outermost() -> bool:
    """Whether no store operation runs on this thread yet (the next one is the outermost)."""
    return _calls.operation is None


def current_operation(default: str) -> str:
    return _calls.operation or default


def note_commit() -> None:
    """A transaction committed on this thread (called by ``Store.begin``)."""
    _calls.commits += 1


def commits() -> int:
    """How many transactions this thread committed so far: a retry is safe only if none did."""
    return _calls.commits
