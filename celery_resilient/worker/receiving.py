"""What the worker's main process hears, put into the store before it can be lost.

``task_received``: every delivery of a resumable task (running and prefetched alike) is
recorded as reserved by this worker incarnation, with its message, so that if the worker
dies the message can be re-published in seconds instead of waiting for the broker.

``task_revoked``: a delivery Celery discarded (revoked, expired) or terminated ends its work,
so it is never mistaken for an orphan. :class:`RevokeWatcher` copies Celery's in-memory
revoke list (``app.control.revoke``) into the store, so a revoke outlives the worker that
heard it.

The event loop only appends to the runtime's buffers; the maintainer thread writes them.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.state import revoked as celery_revoked

from celery_resilient.core import messages, workkey
from celery_resilient.core.states import EXPIRED, REVOKED
from celery_resilient.errors import ResilientError
from celery_resilient.runtime.outcomes import Outcome
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.sql import Receipt
from celery_resilient.tasks.task import ResumableTask

log = logging.getLogger(__name__)


def record_received(rt: Runtime, request: Any) -> None:
    task = request.task
    if not isinstance(task, ResumableTask):
        return
    rt.unacked.add(request.id)
    if rt.dispatcher is not None and request.eta is None and not task.rate_limit:
        return  # taken (with its message) before it reaches the pool: worker/dispatch/
    msg = request.message
    try:
        key = workkey.derive(task, request.id, request.args, request.kwargs, msg.headers)
        # No argument digest here (JSON of the arguments on the event loop, ~0.2 ms per
        # message): the take records it, and a conflicting copy is refused there.
        rt.receipts.add(Receipt(key, request.name, request.id, None,
                                messages.from_kombu(msg)))
    except ResilientError as exc:
        log.error("could not record receipt of %s: %s", request.id, exc,
                  extra={"action": "receipt_failed", "task_id": request.id})


def record_revoked(rt: Runtime, task: Any, request: Any, terminated: bool,
                   expired: bool) -> None:
    """Celery's ``task_revoked``: a delivery discarded (revoked, expired) or terminated."""
    task_id = getattr(request, "id", None)
    if not task_id or not isinstance(task, ResumableTask):
        return
    if expired:
        rt.outcomes.add(Outcome(task_id, EXPIRED, "its expires passed before it ran"))
    elif terminated:
        rt.outcomes.add(Outcome(task_id, REVOKED, "revoked with terminate=True"))
    else:
        rt.outcomes.add(Outcome(task_id, REVOKED, "revoked by task id"))


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

    def flush(self, rt: Runtime) -> int:
        ids = self.pending()
        if not ids:
            return 0
        ended = rt.store.record_revocations(ids)
        self._recorded.update(ids)
        log.info("recorded %d revoked task id(s); %d unstarted work(s) ended", len(ids), ended,
                 extra={"action": "revocations_recorded", "task_ids": ids[:20]})
        return len(ids)
