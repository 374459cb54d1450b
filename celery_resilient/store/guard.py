"""The retry guard of every store operation, and how it tells an interrupt, a transient
error and a lost server apart.

Every store method that runs a transaction is ``@guarded``; the query modules import it from
here, with the plumbing of :mod:`.db`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError, StatementError

from celery_resilient.errors import StoreUnavailable, StoreUnreachable
from celery_resilient.store import deadlines, packet_limit, transient
from celery_resilient.store import engine as engine_module

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


def guarded(fn: Callable[P, T]) -> Callable[P, T]:
    """Run one store operation; a transient database error becomes :class:`StoreUnavailable`.

    Invariant of every method it wraps: each transaction it runs begins and ends inside the
    call, and nothing outside the database changes before that transaction commits. Only
    that makes a re-run safe. So a transaction the server rolled back and said so
    (serialization failure, deadlock, lock timeout, SQLITE_BUSY: see :mod:`.transient`) is
    run again, up to ``transient.RETRIES`` times after a short jittered pause; and a pooled
    connection found dead (the server restarted since it was used) is retried once on a fresh
    one, which replaces a pre-ping round trip on every checkout. A call that already committed
    a transaction (a batched operator action) is never re-run, and a failure *at commit* has
    an unknown outcome: ``Store.begin`` raises it as unavailable, never retried. What still
    fails transiently is :class:`StoreUnavailable` naming the operation and the SQLSTATE; any
    other error (an integrity violation, a bug) propagates unchanged.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        name = _operation(fn, args)
        outer = transient.enter_operation(name)
        try:
            if outer is None:
                engine_module.forget_swallowed_interrupt()
            seconds = deadlines.thread_default()
            if seconds is None or deadlines.current() is not None:  # unbounded, or nested
                return _attempts(fn, args, kwargs, name, deadlines.current())
            with deadlines.bounded(seconds) as scope:
                return _attempts(fn, args, kwargs, name, scope)
        finally:
            transient.leave_operation(outer)

    return wrapper


def _attempts(fn: Callable[P, T], args: Any, kwargs: Any, name: str,
              scope: deadlines.Scope | None) -> T:
    """Run ``fn`` once, again where that is safe (see :func:`guarded`), and name what failed."""
    op = transient.current_operation(name)
    committed, reruns, reconnected = transient.commits(), 0, False
    handling = sys.exc_info()[1]  # the caller's, e.g. a shutdown's WorkerShutdown
    while True:
        try:
            result = fn(*args, **kwargs)
            # a soft time limit a pool's reset met during the call (SQLAlchemy hid it)
            engine_module.raise_swallowed_interrupt()
            return result
        except DBAPIError as exc:
            interrupt = _interrupt_behind(exc, handling)
            if interrupt is not None:
                raise interrupt from None
            too_large = packet_limit.refused(exc)
            if too_large is not None:
                raise too_large from exc
            if scope is not None and scope.expired:
                raise StoreUnreachable(
                    f"store did not answer within {scope.seconds:g}s during {op} "
                    "(connection closed; a stalled pooler, proxy or server answers "
                    "nothing while TCP stays up)") from exc
            if transient.commits() == committed:
                if transient.is_retryable(exc) and reruns < transient.RETRIES:
                    reruns += 1
                    log.info("%s during %s; running it again (%d/%d)",
                             transient.describe(exc), op, reruns, transient.RETRIES,
                             extra={"action": "store_rerun"})
                    transient.pause(reruns)
                    continue
                if exc.connection_invalidated and not reconnected:
                    reconnected = True
                    log.info("store connection was stale during %s; retrying once", op)
                    continue
            if not isinstance(exc, OperationalError) and not transient.is_transient(exc):
                raise
            what = ("connection lost" if exc.connection_invalidated else
                    "unavailable" if transient.is_transient(exc) else "unreachable")
            error = StoreUnavailable if what == "unavailable" else StoreUnreachable
            raise error(f"store {what} during {op} "
                        f"({transient.describe(exc)}): {exc.orig}") from exc
        except StatementError as exc:
            # SQLAlchemy wraps what interrupted its own code mid-statement (Celery's
            # SoftTimeLimitExceeded, raised from a signal handler): the task must see
            # that exception itself, as its handlers expect.
            orig = exc.orig
            if isinstance(orig, BaseException) and _is_interrupt(orig):
                raise orig from None
            raise


def _operation(fn: Callable[..., object], args: tuple[object, ...]) -> str:
    """What the operation is called in messages: a method by the class it was called on
    (``Store.take``, wherever the store's concept modules define it)."""
    if "." in fn.__qualname__ and args:
        return f"{type(args[0]).__name__}.{fn.__name__}"
    return fn.__qualname__


def _interrupt_behind(exc: BaseException, handling: BaseException | None) -> BaseException | None:
    """What interrupted the call, when ``exc`` was only raised cleaning up after it.

    A soft time limit raised while a read's ``ROLLBACK`` waited for the server leaves the
    connection mid-protocol; closing it then fails with "another command is already in
    progress", chained to the interrupt. The caller must see the interrupt (its handlers
    expect it), not a store outage that re-sends the task.

    ``handling`` is the exception the caller was already handling when the call began: it
    ends every chain raised inside the call, and it did not interrupt the call. Celery's warm
    shutdown runs the worker's ``stop`` steps inside ``except SystemExit`` (its
    ``WorkerShutdown``); taking that for an interrupt re-raised it out of our shutdown step
    and left the worker hanging at exit, its pool never joined.
    """
    seen = exc.__context__
    for _ in range(5):
        if seen is None or seen is handling:
            return None
        if _is_interrupt(seen):
            return seen
        seen = seen.__context__
    return None


def _is_interrupt(exc: BaseException) -> bool:
    """Raised asynchronously into whatever code ran: billiard's soft time limit (also what
    ``revoke(terminate=True, signal="SIGUSR1")`` raises), or the process being stopped."""
    return isinstance(exc, (KeyboardInterrupt, SystemExit)) or \
        type(exc).__module__.startswith("billiard")


def server_gone(exc: BaseException) -> bool:
    """The connection answered as a server that went away or is read-only (a standby during
    a failover): the next attempt needs a fresh connection."""
    return isinstance(exc, DBAPIError) and (
        transient.sqlstate(exc) in transient.LOST_SQLSTATES
        or transient.mysql_errno(exc) in transient.MYSQL_LOST)


def drop(conn: Connection) -> None:
    """Invalidate ``conn`` (its pool opens a fresh one next time), whatever state it is in."""
    if not conn.invalidated:
        with contextlib.suppress(Exception):
            conn.invalidate()
