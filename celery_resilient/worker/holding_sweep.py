"""The part of each sweep that gives a gone worker's held messages back to their queues.

On Redis with the reliable fetch, every message a worker took is in its incarnation's
holding until acknowledged (:mod:`celery_resilient.broker`). Once the store says that
incarnation is gone (stopped, proven dead, or its lease expired), the sweep pushes its
holding back onto the front of the queues, plain tasks and resumable ones alike, running
or prefetched, marked redelivered, as RabbitMQ does when a consumer's connection drops.
Nothing is left in Redis's ``unacked`` hash for the visibility timeout to deliver an hour
later. The store's re-publish of the same work is then skipped: the broker's copy is back.

A holding whose incarnation the store does not know (a worker of another store, or a row
pruned long ago) is left to kombu's rule: messages past the visibility timeout go back.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery_resilient.broker import holdings
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime

log = logging.getLogger(__name__)


class HoldingSweep:
    """Restores the holdings of gone incarnations; remembers what went back, for a while."""

    def __init__(self, rt: Runtime, owner: Owner) -> None:
        self.rt = rt
        self.owner = owner
        #: task id -> monotonic time its message went back to its queue
        self._restored: dict[str, float] = {}

    @property
    def memory_seconds(self) -> float:
        """How long a restored task id is remembered: the store's hold on re-published
        work, after which an orphan not taken is re-published from the store anyway."""
        cfg = self.rt.config
        return max(cfg.submit_timeout, 10 * cfg.sweep_interval)

    def run(self, conn: Any, judge_leases: bool) -> int:
        """Give back what gone incarnations hold; return how many messages went back."""
        channel = conn.default_channel
        if not holdings.is_redis(channel):
            return 0
        found = holdings.holders(channel)
        others = [inc for inc in found if inc != self.owner.incarnation]
        if not others:
            return 0
        gone, unknown = self.rt.store.gone_incarnations(
            others, self.owner, self.rt.config.lease_seconds, judge_leases)
        count = 0
        for incarnation in sorted(gone):
            count += self._give_back(channel, incarnation, "gone", None)
        if unknown:
            ceiling = holdings.visibility_ceiling(channel)
            for incarnation in sorted(unknown):
                count += self._give_back(channel, incarnation, "unknown to the store", ceiling)
                holdings.forget_empty(channel, incarnation)
        return count

    def _give_back(self, channel: Any, incarnation: str, why: str,
                   older_than: float | None) -> int:
        back = holdings.restore(channel, incarnation, older_than=older_than)
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


__all__ = ["HoldingSweep"]
