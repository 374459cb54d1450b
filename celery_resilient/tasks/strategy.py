"""ResumableTask's worker strategy: Celery's default one, with a request that is to run now
handed to the worker's batched takes first (``celery_resilient.worker.dispatch``).

Celery's default strategy sends a request that is to run now straight to the pool
(``consumer.on_task_request``); ETA, countdown and rate-limited requests reach the pool
later by the consumer's own path and take their claims in their pool process. This strategy
gives Celery's a consumer whose ``on_task_request`` goes through the dispatcher when the
worker has one; everything else is the consumer itself.

A broker's redelivery of a request that is executing in this very worker is acknowledged
here, in the main process, and runs nothing: RabbitMQ redelivers every unacknowledged
message of a channel it closed (``consumer_timeout``: a task that ran longer than it), and
the execution goes on with its claim. Waiting for a pool process, as the copy otherwise
would, keeps it unacknowledged for as long as the original runs, so the broker's timeout
closes the new channel too, again and again. Should the execution die after that, its claim
is released by the worker's reconcile and re-published from the store.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker import state as worker_state
from celery.worker.strategy import default

from celery_resilient.runtime.runtime import Runtime

log = logging.getLogger(__name__)


def resumable(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """``ResumableTask.Strategy``: Celery's default strategy through the dispatcher (on a
    worker whose app runs without ``Resilient(app)``, Celery's default strategy alone)."""
    rt = Runtime.enabled_on(app)
    return default(task, app, consumer if rt is None else _Dispatching(consumer, rt), **kwargs)


class _Dispatching:
    """The consumer as Celery's strategy sees it, with the batched takes in front of the
    pool."""

    def __init__(self, consumer: Any, rt: Runtime) -> None:
        self._consumer = consumer
        self._rt = rt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    def on_task_request(self, request: Any) -> None:
        original = running_original(request)
        if original is not None:
            settle_copy(request, original)
            return
        dispatcher = self._rt.dispatcher
        if dispatcher is not None and dispatcher.accepts():
            dispatcher.submit(request, self._consumer.on_task_request)
        else:
            self._consumer.on_task_request(request)


def running_original(request: Any) -> Any | None:
    """The request executing here now that ``request`` is a broker's redelivery of (same
    task id, same try, received on a channel since replaced), if any. Only a redelivered
    message is looked at: a retry's new message reuses the task id while its try still
    runs, and must run."""
    if not request.delivery_info.get("redelivered"):
        return None
    try:
        active = list(worker_state.active_requests)
    except RuntimeError:  # changed while copied: the pool process's take decides
        return None
    for other in active:
        if (other is not request and other.id == request.id
                and other.request_dict.get("retries") == request.request_dict.get("retries")
                and other.message.channel is not request.message.channel):
            return other  # received on a channel since closed: its delivery is this one
    return None


def settle_copy(request: Any, original: Any) -> None:
    """Acknowledge ``request`` (a redelivered copy of ``original``) and forget it: Celery's
    own records keep naming the execution that runs."""
    worker_state.reserved_requests.discard(request)
    worker_state.requests[request.id] = original
    original.settled_by_copy = True  # its own ack or reject would meet a closed channel
    request.acknowledge()
    log.warning("%s[%s]: redelivered while it runs here (its first delivery's channel was "
                "closed: a consumer timeout or a lost connection); the copy is acknowledged "
                "and runs nothing, the execution goes on", request.name, request.id,
                extra={"action": "copy_of_running_settled", "task_id": request.id})
