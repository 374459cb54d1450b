"""``Resilient(app)``: the one call that installs celery-resilient on a Celery app.

It sits on top of every layer: the runtime it extends (settings, store, buffers), the
worker bootsteps, the main-process signal receivers, and the Flask extension pattern.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from celery_resilient.broker import link, selection
from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.tasks import submission
from celery_resilient.tasks.task import ResumableTask
from celery_resilient.worker import receiving
from celery_resilient.worker.connection import ConnectionLossStep
from celery_resilient.worker.step import ResilientWorkerStep


class Resilient(Runtime):
    """Attach restart resilience to a Celery app.

    Reads ``resilient_*`` settings (lazily, once: the app may be configured after this
    call), records every resumable delivery, and adds the worker bootstep that renews
    leases and re-publishes orphans.
    """

    def __init__(self, app: Celery) -> None:
        super().__init__(app)
        app.steps["worker"].add(ResilientWorkerStep)
        app.steps["worker"].add("celery_resilient.beat.once:SlotOnceStep")  # 1 start per slot
        app.steps["consumer"].add(ConnectionLossStep)
        # Every task message is sent through it (apply_async, canvases, beat): durable submit
        app.send_task = submission.covering(
            self, app.send_task, lambda task: isinstance(task, ResumableTask))
        # Weak receivers: the app holds this object, so they live exactly as long as the app.
        signals.task_received.connect(self._on_task_received)
        signals.task_revoked.connect(self._on_task_revoked)
        signals.worker_process_init.connect(self._on_process_init)
        signals.worker_init.connect(self._on_worker_init)

    def init_app(self, flask_app: Any) -> None:
        """Flask extension pattern: read ``RESILIENT_*`` keys from ``flask_app.config``.

        ``RESILIENT_STORE_URL`` becomes ``resilient_store_url`` and so on; the settings are
        validated at once and the runtime is registered as
        ``flask_app.extensions["celery_resilient"]`` (see ``docs/flask.md``). Call it before
        the settings are first used (before a worker starts or a task is sent).
        """
        if self.has_config():
            raise ConfigurationError(
                f"init_app() came after the settings of Celery app {self.app.main!r} were "
                "read; call it where the Flask app is created, before any task is sent")
        from celery_resilient.contrib.flask import init_app  # noqa: PLC0415  (Flask is optional)

        init_app(self, flask_app)

    # -- signal receivers (only for this app's tasks) -------------------------------------

    def _on_task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is not None and request.task.app is self.app:
            receiving.record_received(self, request)

    def _on_task_revoked(self, sender: Any = None, request: Any = None,
                         terminated: bool = False, expired: bool = False, **_: Any) -> None:
        if getattr(sender, "app", None) is self.app:
            receiving.record_revoked(self, sender, request, terminated, expired)

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        """Before the worker's consumer connects: consume Redis through the reliable fetch,
        and bound the broker link (socket timeouts, keepalives, heartbeats)."""
        if getattr(sender, "app", None) is self.app:
            self.fetch_mode = selection.apply(self.app, self.config.reliable_fetch)
            self.broker_link, self.broker_link_warnings = link.apply(sender.app.conf)

    def _on_process_init(self, **_: Any) -> None:
        self.dispose_store()
