"""``Resilient(app)``: the one wiring point between a Celery app and the durable store."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, signals

from . import checks, outcomes, receipts
from .config import ResilientConfig, sanitize_url
from .errors import ConfigurationError
from .store.sql import Owner, Store

log = logging.getLogger(__name__)
_ATTR = "_celery_resilient"


class Resilient:
    """Attach restart resilience to a Celery app.

    Reads ``resilient_*`` settings (lazily, once: the app may be configured after this
    call), records every resumable delivery, and adds the worker bootstep that renews
    leases and re-publishes orphans.
    """

    def __init__(self, app: Celery) -> None:
        if getattr(app, _ATTR, None) is not None:
            raise ConfigurationError(f"Resilient() was already applied to app {app.main!r}")
        self.app = app
        self._config: ResilientConfig | None = None
        self._store: Store | None = None
        self._schema_ready = False
        self._lock = threading.Lock()
        self.receipts = receipts.ReceiptBuffer()
        self.held = receipts.HeldRequests()
        self.resent = outcomes.RecentlyResent()
        self.outcomes = outcomes.OutcomeBuffer(self.receipts.arrived)
        setattr(app, _ATTR, self)
        from .worker import ResilientWorkerStep

        app.steps["worker"].add(ResilientWorkerStep)
        app.steps["worker"].add("celery_resilient.beat.once:SlotOnceStep")  # 1 start per slot
        # Weak receivers: the app holds this object, so they live exactly as long as the app.
        signals.task_received.connect(self._on_task_received)
        signals.task_revoked.connect(self._on_task_revoked)
        signals.worker_process_init.connect(self._on_process_init)

    @classmethod
    def enabled_on(cls, app: Celery) -> Resilient | None:
        """The runtime of ``app``, or None when ``Resilient(app)`` was never applied."""
        rt: Resilient | None = getattr(app, _ATTR, None)
        return rt

    @classmethod
    def of(cls, app: Celery) -> Resilient:
        rt: Resilient | None = getattr(app, _ATTR, None)
        if rt is None:
            raise ConfigurationError(
                f"celery-resilient is not enabled on app {app.main!r}: call Resilient(app) "
                "where the app is created"
            )
        return rt

    def init_app(self, flask_app: Any) -> None:
        """Flask extension pattern: read ``RESILIENT_*`` keys from ``flask_app.config``.

        ``RESILIENT_STORE_URL`` becomes ``resilient_store_url`` and so on; the settings are
        validated at once and the runtime is registered as
        ``flask_app.extensions["celery_resilient"]`` (see ``docs/flask.md``). Call it before
        the settings are first used (before a worker starts or a task is sent).
        """
        if self._config is not None:
            raise ConfigurationError(
                f"init_app() came after the settings of Celery app {self.app.main!r} were "
                "read; call it where the Flask app is created, before any task is sent")
        from .contrib.flask import init_app

        init_app(self, flask_app)

    @property
    def config(self) -> ResilientConfig:
        if self._config is None:
            self._config = ResilientConfig.from_mapping(self.app.conf)
        return self._config

    @property
    def store(self) -> Store:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    cfg = self.config
                    self._store = Store(cfg.store_url, cfg.table_prefix)
        if not self._schema_ready:
            with self._lock:
                if not self._schema_ready:
                    self._store.ensure_schema(self.config.migrates_itself)
                    self._schema_ready = True
        return self._store

    def startup(self, owner: Owner) -> None:
        """Worker main process start: validate, check the schema, warn about broker limits."""
        cfg = self.config
        _ = self.store
        log.info(
            "celery-resilient: store=%s lease=%gs heartbeat=%gs sweep=%gs "
            "max_attempts=%d durable_submit=%s node=%s incarnation=%s",
            sanitize_url(cfg.store_url), cfg.lease_seconds, cfg.heartbeat_interval,
            cfg.sweep_interval, cfg.max_attempts, cfg.durable_submit, owner.node,
            owner.incarnation, extra={"action": "startup"},
        )
        for warning in checks.time_limit_warnings(self.app):
            log.warning(warning, extra={"action": "config_warning"})

    # -- signal receivers -----------------------------------------------------------------

    def _mine(self, task_app: Any) -> bool:
        return task_app is self.app

    def _on_task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is not None and self._mine(request.task.app):
            receipts.record_received(self, request)

    def _on_task_revoked(self, sender: Any = None, request: Any = None,
                         terminated: bool = False, expired: bool = False, **_: Any) -> None:
        from .task import ResumableTask

        if isinstance(sender, ResumableTask) and self._mine(sender.app):
            outcomes.on_task_revoked(self, request, terminated, expired)

    def _on_process_init(self, **_: Any) -> None:
        if self._store is not None:
            self._store.dispose()  # never reuse the parent's pooled connections
