"""Outcomes only the worker's main process sees, recorded so the work ends exactly once.

A pool process records what its task body did (done, failed, handed back). Some endings
happen outside the body: Celery discards a delivery as revoked or expired, terminates a
running task (``revoke(terminate=True)``), or kills a pool process at its hard time limit.
Left alone, each would look like a dead worker and be re-published. The main process queues
them here (its event loop never waits on the store) and the maintainer thread writes them
before it renews leases or sweeps, so an ended request is never mistaken for an orphan.

``RevokeWatcher`` copies Celery's in-memory revoke list (``app.control.revoke``) into the
store, so a revoke outlives the worker that heard it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.worker.request import Request
from celery.worker.state import revoked as celery_revoked

from .states import EXPIRED, FAILED, REVOKED

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    task_id: str
    state: str
    error: str


class OutcomeBuffer:
    """Ended requests waiting for the maintainer thread to record them."""

    def __init__(self, wake: threading.Event) -> None:
        self._items: deque[Outcome] = deque()
        self._lock = threading.Lock()
        self._wake = wake

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self._items.append(outcome)
        self._wake.set()

    def take_all(self) -> list[Outcome]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
        return items

    def put_back(self, items: list[Outcome]) -> None:
        with self._lock:
            self._items.extendleft(reversed(items))

    def flush(self, rt: Resilient) -> int:
        """Write every queued outcome; a store outage keeps them for the next round."""
        items = self.take_all()
        for i, outcome in enumerate(items):
            try:
                changed = rt.store.end_request(outcome.task_id, outcome.state, outcome.error)
            except Exception:
                self.put_back(items[i:])
                raise
            if not changed:
                log.debug("request %s had already ended (%s not recorded)", outcome.task_id,
                          outcome.state)
                continue
            log.info("request %s ended %s: %s", outcome.task_id, outcome.state, outcome.error,
                     extra={"action": f"work_{outcome.state}", "task_id": outcome.task_id,
                            "rows": changed})
        return len(items)


class RecentlyResent:
    """Task ids whose execution re-sent itself (the store was down mid-task).

    Its claim stays ``running`` with nobody executing it until the copy arrives and takes
    it over (the copy names the epoch it supersedes); while the store stays down the copy
    re-sends itself again, possibly from another worker. The worker must not release such
    a claim as "running nowhere" meanwhile, or a sweep would re-publish it and count a
    death. An id is kept for ``window`` seconds after it was re-sent or after the store
    was last unreachable, whichever is later.
    """

    def __init__(self) -> None:
        self._sent: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def add(self, task_id: str, window: float) -> None:
        with self._lock:
            self._sent[task_id] = (time.monotonic(), window)

    def snapshot(self, store_down_at: float | None = None) -> frozenset[str]:
        """The ids still covered; ``store_down_at``: monotonic time of the last outage."""
        now = time.monotonic()
        with self._lock:
            for task_id, (sent, window) in list(self._sent.items()):
                if max(sent, store_down_at or 0.0) + window < now:
                    del self._sent[task_id]
            return frozenset(self._sent)


def on_task_revoked(rt: Resilient, request: Any, terminated: bool, expired: bool) -> None:
    """Celery's ``task_revoked``: a delivery discarded (revoked, expired) or terminated."""
    task_id = getattr(request, "id", None)
    if not task_id:
        return
    if expired:
        rt.outcomes.add(Outcome(task_id, EXPIRED, "its expires passed before it ran"))
    elif terminated:
        rt.outcomes.add(Outcome(task_id, REVOKED, "revoked with terminate=True"))
    else:
        rt.outcomes.add(Outcome(task_id, REVOKED, "revoked by task id"))


class ResumableRequest(Request):  # type: ignore[misc]
    """The main process's request of a ResumableTask.

    A hard time limit ends the work: without this, the pool process killed at its hard limit
    looks like a dead worker, and the claim would be re-published and the task re-run,
    although the caller already got ``TimeLimitExceeded``. A time limit is the task's own
    failure, as in Celery. Acknowledging or rejecting the message releases it from the
    worker's held requests, so the heartbeat stops renewing a claim nobody holds.
    """

    def acknowledge(self) -> None:
        was = self.acknowledged
        super().acknowledge()
        self._released(was)

    def reject(self, requeue: bool = False) -> None:
        was = self.acknowledged
        super().reject(requeue)
        self._released(was)

    def on_retry(self, exc_info: Any) -> None:
        """A retry or a store-outage re-send: its copy is in flight to take the claim."""
        super().on_retry(exc_info)
        from .app import Resilient

        rt = Resilient.enabled_on(self.task.app)
        if rt is not None:
            cfg = rt.config
            rt.resent.add(self.id, 2 * cfg.store_retry_max + cfg.lease_seconds)

    def _released(self, was_acknowledged: bool) -> None:
        if was_acknowledged or not self.acknowledged:
            return
        from .app import Resilient

        rt = Resilient.enabled_on(self.task.app)
        if rt is not None:
            rt.held.release(self.id)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        from celery.worker.state import should_terminate

        super().on_timeout(soft, timeout)
        if soft or should_terminate:  # a cold shutdown is not the task's failure
            return
        from .app import Resilient

        rt = Resilient.enabled_on(self.task.app)
        if rt is not None:
            rt.outcomes.add(Outcome(self.id, FAILED, f"TimeLimitExceeded({timeout})"))


class RevokeWatcher:
    """Copies new entries of Celery's revoke list into the store (maintainer thread)."""

    def __init__(self) -> None:
        self._recorded: set[str] = set()

    def pending(self) -> list[str]:
        try:
            current = set(celery_revoked)  # a copy: the event loop keeps adding
        except RuntimeError:  # changed while copied: next round
            return []
        self._recorded &= current  # forget what Celery forgot
        return sorted(current - self._recorded)

    def flush(self, rt: Resilient) -> int:
        ids = self.pending()
        if not ids:
            return 0
        ended = rt.store.record_revocations(ids)
        self._recorded.update(ids)
        log.info("recorded %d revoked task id(s); %d unstarted work(s) ended", len(ids), ended,
                 extra={"action": "revocations_recorded", "task_ids": ids[:20]})
        return len(ids)
