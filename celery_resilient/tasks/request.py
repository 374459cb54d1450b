"""The main process's request class of a ResumableTask: endings only it sees."""

from __future__ import annotations

from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import states
from celery.worker import state as worker_state
from celery.worker.request import Request

from celery_resilient.core import codec
from celery_resilient.core.states import FAILED
from celery_resilient.errors import StoreUnreachable
from celery_resilient.runtime.outcomes import Outcome
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.tasks import replay


class ResumableRequest(Request):  # type: ignore[misc]
    """The main process's request of a ResumableTask.

    A hard time limit ends the work: without this, the pool process killed at its hard limit
    looks like a dead worker, and the claim would be re-published and the task re-run,
    although the caller already got ``TimeLimitExceeded``. A time limit is the task's own
    failure, as in Celery. Acknowledging or rejecting the message releases it from the
    worker's held requests, so the heartbeat stops renewing a claim nobody holds.
    """

    #: Its delivery was settled by the broker's redelivered copy (``tasks/strategy.py``):
    #: its channel is closed, so its own acknowledgement or rejection is only recorded.
    settled_by_copy = False
    acknowledged: bool  # Celery's, set here too when a copy settled the delivery

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        super().on_accepted(pid, time_accepted)
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None and rt.dispatcher is not None:
            rt.dispatcher.started(self, pid)

    def acknowledge(self) -> None:
        """Acknowledge, once the result is durable: a request whose claim the worker's
        batched takes handed to the pool finished without waiting for the WAL flush, so its
        acknowledgement waits for the dispatcher's next flush (worker/dispatch/acks.py)."""
        rt = Runtime.enabled_on(self.task.app)
        dispatcher = rt.dispatcher if rt is not None else None
        if dispatcher is not None and not self.acknowledged and dispatcher.defer_ack(self):
            return
        self.acknowledge_now()

    def acknowledge_now(self) -> None:
        was = self.acknowledged
        if self.settled_by_copy:
            self.acknowledged = True
        else:
            super().acknowledge()
        self._released(was)

    def reject(self, requeue: bool = False) -> None:
        was = self.acknowledged
        if self.settled_by_copy:  # its execution died: the worker's reconcile re-publishes
            self.acknowledged = True
        else:
            super().reject(requeue)
        self._released(was)

    def on_retry(self, exc_info: Any) -> None:
        """A retry or a store-outage re-send: its copy is in flight to take the claim. A
        re-send because the store could not be reached pauses consumption at once (its gate
        resumes it after the maintainer's next round that reaches the store): waiting for
        the maintainer to notice lets the worker churn through the backlog, re-sending each
        message, for as long as a round takes to fail. A transient conflict the store
        answered with (a serialization failure, a lock timeout) pauses nothing."""
        super().on_retry(exc_info)
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None:
            cfg = rt.config
            rt.resent.add(self.id, 2 * cfg.store_retry_max + cfg.lease_seconds)
            retry = exc_info.exception
            if isinstance(retry, ExceptionWithTraceback):  # from a pool process
                retry = retry.exc
            cause = getattr(retry, "exc", None)
            if isinstance(cause, StoreUnreachable) and rt.gate is not None:
                rt.gate.store_down(str(cause))

    def _released(self, was_acknowledged: bool) -> None:
        if was_acknowledged or not self.acknowledged:
            return
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None:
            rt.unacked.release(self.id)
            if rt.dispatcher is not None:
                rt.dispatcher.forget(self)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        """A pool process lost after its task stored SUCCESS: Celery acknowledges the
        message (counting the chord part again could count it twice on some backends), so
        a kill between SUCCESS and the count would leave the chord waiting. Count it again
        here where the backend counts each part once (tasks/replay.py)."""
        exc = exc_info.exception
        exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback wraps it
        rt = Runtime.enabled_on(self.task.app)
        if isinstance(exc, WorkerLostError) and rt is not None and rt.dispatcher is not None:
            rt.dispatcher.lost(self)  # a claim it handed: the next take counts the death
        if isinstance(exc, WorkerLostError) and self._context.chord:
            try:
                meta = self.task.backend.get_task_meta(self.id)
            except Exception:  # the backend down: Celery's own handling decides
                meta = {}
            if meta.get("status") == states.SUCCESS:
                replay.report_again(self.task.backend, self._context, states.SUCCESS,
                                    meta.get("result"))
                # killed while it sent the chord's body: send it once its claim expires
                replay.finish_dispatch_later(self.task.backend, self._context,
                                             states.SUCCESS, meta.get("result"))
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if soft or worker_state.should_terminate:  # a cold shutdown is not the task's failure
            return
        rt = Runtime.enabled_on(self.task.app)
        if rt is not None:
            rt.outcomes.add(Outcome(self.id, FAILED, f"TimeLimitExceeded({timeout})",
                                    codec.failure_json(TimeLimitExceeded(timeout))))
