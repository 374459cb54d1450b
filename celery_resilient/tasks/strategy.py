"""ResumableTask's worker strategy: Celery's default one, with a request that is to run now
handed to the worker's batched takes first (``celery_resilient.worker.dispatch``).

Celery's default strategy sends a request that is to run now straight to the pool
(``consumer.on_task_request``); ETA, countdown and rate-limited requests reach the pool
later by the consumer's own path and take their claims in their pool process. This strategy
gives Celery's a consumer whose ``on_task_request`` goes through the dispatcher when the
worker has one; everything else is the consumer itself.
"""

from __future__ import annotations

from typing import Any

from celery.worker.strategy import default

from celery_resilient.runtime.runtime import Runtime


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
        dispatcher = self._rt.dispatcher
        if dispatcher is not None and dispatcher.accepts():
            dispatcher.submit(request, self._consumer.on_task_request)
        else:
            self._consumer.on_task_request(request)
