"""The main process's request class of a ResumableTask: endings only it sees."""

from __future__ import annotations

from typing import Any

from celery.worker import state as worker_state
from celery.worker.request import Request

from celery_resilient.core.states import FAILED
from celery_resilient.runtime.outcomes import Outcome
from celery_resilient.runtime.runtime import Runtime


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
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None:
            cfg = rt.config
            rt.resent.add(self.id, 2 * cfg.store_retry_max + cfg.lease_seconds)

    def _released(self, was_acknowledged: bool) -> None:
        if was_acknowledged or not self.acknowledged:
            return
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None:
            rt.held.release(self.id)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if soft or worker_state.should_terminate:  # a cold shutdown is not the task's failure
            return
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None:
            rt.outcomes.add(Outcome(self.id, FAILED, f"TimeLimitExceeded({timeout})"))
