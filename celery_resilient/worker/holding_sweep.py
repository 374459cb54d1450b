"""The part of each sweep that gives a gone worker's held messages back to their queues.

On Redis with the reliable fetch, every message a worker took is in its incarnation's
holding until acknowledged (:mod:`celery_resilient.broker`). How much of it goes back, and
when, follows how surely the store knows that incarnation is gone
(``Store.gone_incarnations``):

- **dead** (it stopped, a successor on its host saw its process gone, or a later start of its
  node name found its session ended): everything, plain tasks and resumable ones, running or
  prefetched, onto the front of the queues, marked redelivered, as RabbitMQ does when a
  consumer's connection drops;
- **unproven** (its lease expired, or another worker found its session ended): it may still
  run, cut off from the store or paused, so only resumable tasks' messages go back (the
  store fences a zombie's executions, and the worker fences itself); a plain task's message
  stays held, as plain Celery keeps it, until the incarnation is proven dead or kombu's
  visibility timeout passes;
- **unknown** to the store (a worker of another store, or a row pruned long ago): kombu's
  rule, messages past the visibility timeout.

The store's re-publish of the same work is skipped for what went back: the broker's copy is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_resilient.broker import holdings
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.tasks.task import ResumableTask
from celery_resilient.worker import connection

log = logging.getLogger(__name__)


class HoldingSweep:
    """Restores the holdings of gone incarnations; remembers what went back, for a while."""

    def __init__(self, rt: Runtime, owner: Owner) -> None:
        self.rt = rt
        self.owner = owner
        #: task id -> monotonic time its message went back to its queue
        self._restored: dict[str, float] = {}
        #: own tags Celery did not know at the last look (given back when seen twice)
        self._forgotten: set[str] = set()

    @property
    def memory_seconds(self) -> float:
        """How long a restored task id is remembered: the store's hold on re-published
        work, after which an orphan not taken is re-published from the store anyway."""
        cfg = self.rt.config
        return max(cfg.submit_timeout, 10 * cfg.sweep_interval)

    def run(self, conn: Any, judge_leases: bool) -> int:
        """Give back what gone incarnations hold, and what this worker fetched on a broker
        connection it has lost; return how many messages went back."""
        channel = conn.default_channel
        if not holdings.is_redis(channel):
            return 0
        count = self.reconcile_own(channel)
        found = holdings.holders(channel)
        others = [inc for inc in found if inc != self.owner.incarnation]
        if not others:
            return count
        gone = self.rt.store.gone_incarnations(
            others, self.owner, self.rt.config.lease_seconds, judge_leases)
        for incarnation in sorted(gone.dead):
            count += self._give_back(channel, incarnation, "gone")
        for incarnation in sorted(gone.unproven):
            count += self._give_back(channel, incarnation, "unproven: resumable work only",
                                     only=self._resumable)
        if gone.unknown:
            ceiling = holdings.visibility_ceiling(channel)
            for incarnation in sorted(gone.unknown):
                count += self._give_back(channel, incarnation, "unknown to the store",
                                         older_than=ceiling)
                holdings.forget_empty(channel, incarnation)
        return count

    def reconcile_own(self, channel: Any) -> int:
        """After a lost broker connection: give back what this worker had fetched before it
        and Celery no longer holds (prefetched and ETA messages of the old connection, a
        fetch whose reply never arrived). Its running tasks keep theirs (Celery still knows
        them). A tag counts as forgotten when two looks a sweep apart find it unknown, so a
        task that ends between the two (no longer known, not yet acknowledged) is not sent
        again."""
        lost_at = self.rt.broker_lost_at
        if lost_at is None:
            return 0
        known = connection.known_task_ids_or_none()
        if known is None:
            return 0
        old = [h for h in holdings.held(channel, self.owner.incarnation)
               if h.present and h.fetched_at is not None and h.fetched_at < lost_at]
        if not old:  # nothing of the old connection is left
            if self.rt.broker_lost_at == lost_at:  # (not a newer loss meanwhile)
                self.rt.broker_lost_at = None
            self._forgotten = set()
            return 0
        unknown = {h.tag for h in old if h.task_id is None or h.task_id not in known}
        ready, self._forgotten = unknown & self._forgotten, unknown - self._forgotten
        if not ready:
            return 0
        back = holdings.restore(channel, self.owner.incarnation, tags=ready)
        if back:
            ids = [h.task_id for h in back if h.task_id]
            log.warning("gave back %d message(s) this worker fetched before its broker "
                        "connection was lost and no longer holds", len(back),
                        extra={"action": "holding_restored", "incarnation":
                               self.owner.incarnation, "count": len(back),
                               "task_ids": ids[:20]})
        return len(back)

    def _resumable(self, held: holdings.Held) -> bool:
        task = self.rt.app.tasks.get(held.task_name) if held.task_name else None
        return isinstance(task, ResumableTask)

    def _give_back(self, channel: Any, incarnation: str, why: str,
                   older_than: float | None = None,
                   only: Callable[[holdings.Held], bool] | None = None) -> int:
        back = holdings.restore(channel, incarnation, older_than=older_than, only=only)
        if not back:
            return 0
        now = time.monotonic()
        ids = [h.task_id for h in back if h.task_id]
        for task_id in ids:
            self._restored[task_id] = now
        log.info("gave back %d message(s) held by incarnation %s (%s) to their queues",
                 len(back), incarnation, why,
                 extra={"action": "holding_restored", "incarnation": incarnation,
                        "count": len(back), "task_ids": ids[:20]})
        return len(back)

    def restored_recently(self, task_id: str) -> bool:
        """Whether this task's message went back to its queue within :attr:`memory_seconds`."""
        cutoff = time.monotonic() - self.memory_seconds
        if self._restored and next(iter(self._restored.values())) < cutoff:
            self._restored = {t: at for t, at in self._restored.items() if at >= cutoff}
        at = self._restored.get(task_id)
        return at is not None and at >= cutoff


def forget_own(rt: Runtime, owner: Owner) -> None:
    """At a clean stop, after kombu gave back what the channel held: drop this incarnation
    from the holders registry (a later sweep would, once the store says it stopped)."""
    with rt.app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT)
        channel = conn.default_channel
        if holdings.is_redis(channel):
            holdings.forget_empty(channel, owner.incarnation)


#: Seconds a stopping worker waits for the broker to forget its holding.
BROKER_TIMEOUT = 2.0

__all__ = ["HoldingSweep", "forget_own"]
