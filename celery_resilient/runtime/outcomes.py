"""Outcomes only the worker's main process sees, recorded so the work ends exactly once.

A pool process records what its task body did (done, failed, handed back). Some endings
happen outside the body: Celery discards a delivery as revoked or expired, terminates a
running task (``revoke(terminate=True)``), or kills a pool process at its hard time limit.
Left alone, each would look like a dead worker and be re-published. The main process queues
them here (its event loop never waits on the store) and the maintainer thread writes them
before it renews leases or sweeps, so an ended request is never mistaken for an orphan.

The receivers that fill the buffer are in ``celery_resilient.worker.receiving`` and
``celery_resilient.tasks.request``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from celery_resilient.store.sql import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    task_id: str
    state: str
    error: str
    #: The exception in Celery's JSON form (a hard time limit's ``TimeLimitExceeded``), kept
    #: so that a copy replaying the failure tells the caller the same exception.
    failure_json: str | None = None


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

    def flush(self, store: Store) -> int:
        """Write every queued outcome; a store outage keeps them for the next round."""
        items = self.take_all()
        for i, outcome in enumerate(items):
            try:
                changed = store.end_request(outcome.task_id, outcome.state, outcome.error,
                                            outcome.failure_json)
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
