"""Round-trip deadlines on store connections: no answer in N seconds is a lost round trip.

A pooler that pauses, a proxy that stalls or a server frozen on its disk keeps every TCP
connection alive and answers nothing. The kernel acknowledges what is sent, so neither
keepalives nor ``tcp_user_timeout`` ever fire, and a statement sent on such a link waits for
ever: a lease renewal that never returns, a liveness ping that never returns. Only the caller
can bound it, so the threads whose work has a deadline (the lease keeper, the liveness
session, the maintainer's sweeps) run each store operation inside :func:`bounded`.

Every connection an operation checks out of a pool while bounded (or holds and names with
:func:`watch`) is registered with this process's :class:`_Watchdog`. Past the
deadline the watchdog shuts the connection's socket down (``shutdown(2)``, not ``close``:
the driver still owns the descriptor). The blocked call then fails at once as a lost
connection, which the caller's retry guard reports as the store being unavailable, and the
pool replaces the connection. Connections are unregistered when they go back to the pool,
so an idle pooled connection is never shut down.

Only drivers with a socket (PostgreSQL, MySQL) are bounded; SQLite waits on file locks,
which its busy timeout bounds.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, event

log = logging.getLogger(__name__)


class Scope:
    """One bounded operation: its deadline and the connections it uses."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        #: Each connection with its socket's descriptor, read when registered (by the thread
        #: that uses it: mysqlclient refuses any call from another thread meanwhile).
        self.conns: dict[int, tuple[Any, int]] = {}
        #: Set by the watchdog when it shut this operation's connections down.
        self.expired = False
        self.ended = False


_local = threading.local()


def current() -> Scope | None:
    """The bounded operation this thread is in, if any."""
    return getattr(_local, "scope", None)


@contextlib.contextmanager
def bounded(seconds: float | None) -> Iterator[Scope | None]:
    """Bound every store round trip made by this thread inside the block to ``seconds``
    from its start (None: unbounded). Nested blocks keep the outer one's deadline."""
    outer = current()
    if seconds is None or outer is not None:
        yield outer
        return
    scope = _local.scope = Scope(seconds)
    try:
        yield scope
    finally:
        _local.scope = None
        _watchdog().end(scope)


def thread_bound(seconds: float | None) -> None:
    """The bound of every guarded store operation this thread runs from now on (None: none)."""
    _local.bound = seconds


def thread_default() -> float | None:
    return getattr(_local, "bound", None)


def _closed(dbapi_conn: Any) -> bool:
    """Read without calling the driver (a plain attribute, safe from any thread): psycopg's
    ``closed``; the MySQL drivers' ``open``."""
    return bool(getattr(dbapi_conn, "closed", False)) or not getattr(dbapi_conn, "open", True)


def _fileno(dbapi_conn: Any) -> int | None:
    try:
        if _closed(dbapi_conn):
            return None
        if not hasattr(dbapi_conn, "fileno"):  # PyMySQL keeps its socket as ``_sock``
            sock = getattr(dbapi_conn, "_sock", None)
            return None if sock is None else int(sock.fileno())
        return int(dbapi_conn.fileno())
    except Exception:  # closed, or a driver without a socket
        return None


def watch(dbapi_conn: Any) -> None:
    """Bound a connection held across operations (checked out before the bounded block)
    by the current block's deadline."""
    _register(dbapi_conn)


def unwatch(dbapi_conn: Any) -> None:
    """End :func:`watch`: the connection stays out of the pool, idle (``store/pinned.py``)."""
    _unregister(dbapi_conn)


def _register(dbapi_conn: Any) -> None:
    scope = current()
    if scope is not None:
        fd = _fileno(dbapi_conn)
        if fd is not None:
            _watchdog().register(scope, dbapi_conn, fd)


def _unregister(dbapi_conn: Any) -> None:
    scope = current()
    if scope is not None:
        _watchdog().unregister(scope, dbapi_conn)


def install(engine: Engine) -> None:
    """Make ``engine``'s connections honour :func:`bounded` (network drivers only). Pool
    events only: a statement listener would turn the hot statements (``store/hot.py``)
    back onto SQLAlchemy's slower path."""

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        _register(dbapi_conn)

    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_conn: Any, _record: Any) -> None:
        if dbapi_conn is not None:
            _unregister(dbapi_conn)



def shut(dbapi_conn: Any, fd: int | None = None) -> bool:
    """Shut the connection's socket down both ways, so a call blocked on it fails now.

    ``fd``: its descriptor as read by the thread that uses it (the watchdog's own thread
    may not ask mysqlclient for it); never used once the connection is closed, when the
    number may name another file."""
    if fd is None:
        fd = _fileno(dbapi_conn)
    if fd is None or _closed(dbapi_conn):
        return False
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True


class _Watchdog(threading.Thread):
    """Shuts down the connections of bounded operations past their deadline. Holds its lock
    only for bookkeeping, never around I/O it waits on."""

    def __init__(self) -> None:
        super().__init__(name="celery-resilient-store-deadlines", daemon=True)
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Scope]] = []
        self._order = itertools.count()

    def register(self, scope: Scope, dbapi_conn: Any, fd: int) -> None:
        with self._cond:
            if scope.ended:
                return
            first = not scope.conns
            scope.conns[id(dbapi_conn)] = (dbapi_conn, fd)
            if scope.expired:  # past its deadline already: no more round trips
                shut(dbapi_conn, fd)
            elif first:
                heapq.heappush(self._heap, (scope.deadline, next(self._order), scope))
                self._cond.notify()

    def unregister(self, scope: Scope, dbapi_conn: Any) -> None:
        with self._cond:
            scope.conns.pop(id(dbapi_conn), None)

    def end(self, scope: Scope) -> None:
        with self._cond:
            scope.ended = True
            scope.conns.clear()

    def run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].ended:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, _, scope = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                if scope.ended or not scope.conns:
                    continue
                scope.expired = True
                conns = list(scope.conns.values())
                for conn, fd in conns:
                    shut(conn, fd)
            log.warning("the store did not answer within %gs: %d connection(s) closed, "
                        "the operation counts as failed", scope.seconds, len(conns),
                        extra={"action": "store_deadline"})


class _ProcessWatchdog:
    """This process's watchdog, started on first use (a forked child starts its own:
    threads do not survive a fork, and a lock a parent's thread held at fork stays held)."""

    def __init__(self) -> None:
        self.pid = 0
        self.dog: _Watchdog | None = None
        self.lock = threading.Lock()

    def get(self) -> _Watchdog:
        if self.pid != os.getpid() or self.dog is None:
            with self.lock:
                if self.pid != os.getpid() or self.dog is None:
                    self.dog = _Watchdog()
                    self.dog.start()
                    self.pid = os.getpid()
        return self.dog

    def after_fork(self) -> None:
        self.pid, self.dog, self.lock = 0, None, threading.Lock()
        _local.__dict__.clear()


_process = _ProcessWatchdog()
_watchdog = _process.get
os.register_at_fork(after_in_child=_process.after_fork)


__all__ = ["Scope", "bounded", "current", "install", "shut", "thread_bound", "thread_default",
           "unwatch", "watch"]
