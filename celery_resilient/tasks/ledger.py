"""The idempotency ledger: global once-per-key effects, and atomic effects in the store's DB."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection

from celery_resilient.core import codec, killpoints
from celery_resilient.errors import LedgerKeyError, StoreUnavailable, StoreUnreachable
from celery_resilient.store import packet_limit, transient
from celery_resilient.store.sql import Store
from celery_resilient.tasks.execution import Execution, atomic_open, refuse_inside_atomic

log = logging.getLogger(__name__)
R = TypeVar("R")
MAX_KEY = 255


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key.strip():
        raise LedgerKeyError(f"ledger key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY:
        raise LedgerKeyError(f"ledger key is {len(key)} chars long; the maximum is {MAX_KEY}")
    return key


class AtomicTransaction:
    """The user's transaction on the store's database, committed with the applied marker.

    ``applied`` is True when this key was already applied by an earlier execution: the body
    should then skip its writes (they were committed then).
    """

    def __init__(self, conn: Connection, key: str, applied: bool) -> None:
        self.connection = conn
        self.key = key
        self.applied = applied
        self.result: Any = None

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        return self.connection.execute(*args, **kwargs)


class Ledger:
    """``once(key, fn)`` and ``atomic(key)``, fenced by the current execution when there is one."""

    def __init__(self, store: Store, execution: Execution | None = None) -> None:
        self._store = store
        self._x = execution

    def applied(self, key: str) -> bool:
        return self._store.ledger_get(_check_key(key)) is not None

    def once(self, key: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``fn`` unless ``key`` is already applied; either way return its result.

        Exactly once for the marker; for an effect outside the store, a crash after ``fn``
        and before the marker commits replays ``fn`` (make it idempotent, or use ``atomic``).
        """
        key = _check_key(key)
        refuse_inside_atomic(f"ledger.once({key!r})")
        stored = self._store.ledger_get(key)
        if stored is not None:
            log.info("ledger key %s already applied; skipping", key,
                     extra={"action": "ledger_skipped", "ledger_key": key})
            result: R = codec.decode(stored, f"stored result of ledger key {key!r}")
            return result
        if self._x is not None:
            self._store.assert_current(self._x.work_key, self._x.epoch)
        result = fn(*args, **kwargs)
        if killpoints.ARMED:
            killpoints.reached("after_effect")
        text = codec.encode(result, f"result for ledger key {key!r}")
        wk, epoch = (self._x.work_key, self._x.epoch) if self._x else (None, None)
        if not self._store.ledger_put(key, wk, epoch, text):
            log.warning("ledger key %s was applied concurrently by other work", key,
                        extra={"action": "ledger_race", "ledger_key": key})
            again = self._store.ledger_get(key)
            if again is not None:
                stored_result: R = codec.decode(again)
                return stored_result
        if killpoints.ARMED:
            killpoints.reached("after_step")
        return result

    @contextmanager
    def atomic(self, key: str | None = None) -> Iterator[AtomicTransaction]:
        """One transaction holding the user's writes and the applied marker for ``key``.

        Use it for effects that live in the store's own database: either both commit or
        neither does, so a replay finds ``tx.applied`` and skips. ``key`` defaults to
        ``"<work key>:atomic"`` of the running work.
        """
        if key is None:
            if self._x is None:
                raise LedgerKeyError("atomic() outside a task needs an explicit key")
            key = f"{self._x.work_key}:atomic"
        key = _check_key(key)
        refuse_inside_atomic(f"ledger.atomic({key!r})")
        wk, epoch = (self._x.work_key, self._x.epoch) if self._x else (None, None)
        operation = f"ledger.atomic({key!r})"
        try:
            with (transient.operation(operation), self._store.begin() as conn,
                  atomic_open(key)):
                if self._x is not None:
                    self._store.fence(conn, self._x.work_key, self._x.epoch)
                # Insert the marker first: a concurrent transaction for the same key then waits
                # on it (PostgreSQL) instead of reading "not applied" and committing its writes.
                applied = not self._store.ledger_mark(conn, key, wk, epoch, "null", fence=False)
                tx = AtomicTransaction(conn, key, applied)
                yield tx
                if not applied:
                    self._store.ledger_set_result(
                        conn, key, codec.encode(tx.result, f"result for ledger key {key!r}"))
        except Exception as exc:
            # The user's block cannot be re-run here, and it was rolled back together with the
            # marker. A transient error (raised by their statements, ours, or the commit) is a
            # store outage: the task is re-sent and runs the block again from its checkpoint.
            # Anything else (their own IntegrityError, a bug) is the task's failure.
            too_large = packet_limit.refused(exc)
            if too_large is not None:
                raise too_large from exc
            if not transient.is_transient(exc):
                raise
            lost = transient.is_lost(exc)
            raise (StoreUnreachable if lost else StoreUnavailable)(
                f"store {'connection lost' if lost else 'unavailable'} during {operation}, "
                f"rolled back ({transient.describe(exc)}): "
                f"{transient.driver_error(exc)}") from exc
