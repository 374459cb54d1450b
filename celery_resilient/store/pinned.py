"""One autocommitted PostgreSQL connection a process keeps checked out for its single statements.

Checking a connection out of SQLAlchemy's pool and back costs about 0.03 ms of CPU (the
pool's events, its proxy, a new ``Connection``): a fifth of a checkpoint save's client CPU,
paid by every take, save and finish. Most store calls of a process come one at a time (a
prefork pool process runs one task), so the caller that finds this connection free uses it
with no checkout, and a concurrent one (threads, greenlets, the main process's threads) takes
one from the pool as before.

It behaves as a pooled connection would between uses:

- a use that raises anything gives it back to the pool (the caller drops it first when the
  server went away), so the next use checks a fresh one out through the pool's own checks;
- a connection left mid-protocol (an interrupt between two uses' bookkeeping) is replaced;
- while a thread is inside :func:`.deadlines.bounded`, the connection is registered with the
  watchdog for the use, as a checkout would register it;
- a forked child never uses its parent's (the state is keyed by PID; psycopg does not close
  a connection another process opened); :meth:`discard` gives it back before the engine is
  disposed, and a store dropped without ``dispose()`` closes it when collected.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine

from celery_resilient.store import deadlines


class _State:
    """One process's pinned connection: the lock that lends it, and what it is."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.conn: Connection | None = None
        self.engine: Engine | None = None


class PinnedConnection:
    """Lends one kept connection of an autocommit engine to one caller at a time."""

    def __init__(self) -> None:
        self._box = [_State()]  # shared with the finalizer, which must not hold self
        self._reset_lock = threading.Lock()
        weakref.finalize(self, _close_kept, self._box)

    def _current(self) -> _State:
        state = self._box[0]
        if state.pid != os.getpid():  # forked: the parent's connection is not ours
            with self._reset_lock:
                if self._box[0].pid != os.getpid():
                    self._box[0] = _State()
                state = self._box[0]
        return state

    @contextmanager
    def lend(self, engine: Engine) -> Iterator[Connection | None]:
        """The kept connection of ``engine`` for this block, or None when another caller has
        it (use the pool then)."""
        state = self._current()
        if not state.lock.acquire(blocking=False):
            yield None
            return
        try:
            conn = _usable(state, engine)
            dbapi = conn.connection.dbapi_connection
            watched = deadlines.current() is not None
            if watched:
                deadlines.watch(dbapi)
            try:
                yield conn
                if conn.in_transaction():  # a Core statement autobegan (no round trip)
                    conn.rollback()
            except BaseException:
                _give_back(state)  # to the pool; invalidated if left mid-statement
                raise
            finally:
                if watched:
                    deadlines.unwatch(dbapi)
        finally:
            state.lock.release()

    def discard(self) -> None:
        """Give the kept connection back to its pool (before the engine is disposed)."""
        state = self._current()
        if not state.lock.acquire(blocking=False):
            return  # in use: its engine's disposal leaves it to the user's close
        try:
            _give_back(state)
        finally:
            state.lock.release()


def _usable(state: _State, engine: Engine) -> Connection:
    conn = state.conn
    if conn is not None and state.engine is not engine:  # the store disposed its engines
        _close_kept([state])
        conn = None
    elif conn is not None and (conn.invalidated or conn.closed
                               or _unfinished(conn.connection.dbapi_connection)):
        _give_back(state)
        conn = None
    if conn is None:
        conn = engine.connect()  # the pool's checkout, with its checks
        state.conn, state.engine = conn, engine
    return conn


def _give_back(state: _State) -> None:
    conn, state.conn, state.engine = state.conn, None, None
    if conn is None:
        return
    if not conn.invalidated and _unfinished(conn.connection.dbapi_connection):
        _quietly(conn.invalidate)
    _quietly(conn.close)


def _quietly(call: Any) -> None:
    """A cleanup whose failure changes nothing (the connection is given up either way), but
    never one that swallows a soft time limit landing in it: the task must see its limit."""
    try:
        call()
    except Exception as exc:
        if type(exc).__module__.startswith("billiard"):
            raise


def _close_kept(box: list[_State]) -> None:
    """Close the kept connection (this process's only) of a store nobody holds any more, or
    of an engine disposed while it was lent."""
    state = box[0]
    conn, state.conn, state.engine = state.conn, None, None
    if conn is not None and state.pid == os.getpid():
        _quietly(conn.invalidate)  # closes it now: its engine may be disposed already


def _unfinished(dbapi_conn: Any) -> bool:
    """Left mid-statement or broken (a local status read): see ``engine._refuse_unfinished``."""
    from psycopg import pq  # noqa: PLC0415 - psycopg is the optional driver

    return bool(dbapi_conn is None
                or dbapi_conn.info.transaction_status != pq.TransactionStatus.IDLE)
