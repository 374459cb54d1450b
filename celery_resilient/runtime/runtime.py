"""The state a Celery app with celery-resilient carries: settings, store and buffers.

Every layer above finds it with :meth:`Runtime.of`; :class:`celery_resilient.Resilient`
(the top-level installer) is the subclass that also wires the worker, beat and frameworks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.runtime.outcomes import OutcomeBuffer, RecentlyResent
from celery_resilient.runtime.receipts import ReceiptBuffer, UnackedDeliveries
from celery_resilient.store.sql import Store

_ATTR = "_celery_resilient"

#: Functions that may redirect a runtime's store URL just before its store is opened, each
#: given the runtime and the URL and returning the URL to use: a framework's test support
#: (Django's test databases) keeps tests off a real database this way.
STORE_URL_FILTERS: list[Callable[[Runtime, str], str]] = []


class Dispatcher(Protocol):
    """Where a resumable request goes instead of straight to the pool (the worker's
    batched takes): its claim is taken first, in the main process."""

    def accepts(self) -> bool: ...
    def submit(self, request: Any, execute: Callable[[Any], None]) -> None: ...
    def started(self, request: Any, pid: int) -> None: ...
    def lost(self, request: Any) -> None: ...
    def defer_ack(self, request: Any) -> bool: ...
    def forget(self, request: Any) -> None: ...
    def finishing(self) -> frozenset[str]: ...


class Gate(Protocol):
    """The worker's consumption gate (worker/backpressure.py): told when the store is down."""

    def store_down(self, reason: str) -> None: ...


class Runtime:
    """Settings (read lazily, once: the app may be configured after this object is made),
    the store (created and schema-checked on first use, per process), and the buffers the
    worker's main process fills on its event loop and its maintainer thread drains."""

    def __init__(self, app: Any) -> None:
        if getattr(app, _ATTR, None) is not None:
            raise ConfigurationError(f"Resilient() was already applied to app {app.main!r}")
        self.app = app
        self._config: ResilientConfig | None = None
        self._store: Store | None = None
        self._schema_ready = False
        self._lock = threading.Lock()
        self.receipts = ReceiptBuffer()
        self.unacked = UnackedDeliveries()
        self.resent = RecentlyResent()
        self.outcomes = OutcomeBuffer(self.receipts.arrived)
        #: The worker's Redis fetch, for the startup banner (set at ``worker_init``).
        self.fetch_mode = "off (no worker_init seen)"
        #: The bounds on the worker's broker link, and warnings about ones turned off.
        self.broker_link = "as configured"
        self.broker_link_warnings: list[str] = []
        #: Wall-clock time the worker's consumer last lost its broker connection (None:
        #: never): what it had fetched before may be held with nobody to run it.
        self.broker_lost_at: float | None = None
        #: The worker's batched takes (worker/dispatch/), when its pool gets them.
        self.dispatcher: Dispatcher | None = None
        #: The worker's consumption gate, while its worker runs.
        self.gate: Gate | None = None
        setattr(app, _ATTR, self)

    @classmethod
    def enabled_on(cls, app: Any) -> Runtime | None:
        """The runtime of ``app``, or None when ``Resilient(app)`` was never applied."""
        rt: Runtime | None = getattr(app, _ATTR, None)
        return rt

    @classmethod
    def of(cls, app: Any) -> Runtime:
        rt: Runtime | None = getattr(app, _ATTR, None)
        if rt is None:
            raise ConfigurationError(
                f"celery-resilient is not enabled on app {app.main!r}: call Resilient(app) "
                "where the app is created"
            )
        return rt

    @property
    def config(self) -> ResilientConfig:
        if self._config is None:
            cfg = ResilientConfig.from_mapping(self.app.conf, getattr(self.app, "namespace", None))
            if cfg.metrics:  # counters follow the signals in this process and its forks
                # optional dependency: prometheus-client (the prometheus extra)
                from celery_resilient.runtime import metrics  # noqa: PLC0415

                metrics.install()
            self._config = cfg
        return self._config

    def has_config(self) -> bool:
        """Whether the settings were read already (they can no longer change)."""
        return self._config is not None

    @property
    def store(self) -> Store:
        if self._store is None:
            with self._lock:
                if self._store is None:
                    cfg = self.config
                    url = cfg.store_url
                    for redirect in STORE_URL_FILTERS:
                        url = redirect(self, url)
                    self._store = Store(url, cfg.table_prefix)
        if not self._schema_ready:
            with self._lock:
                if not self._schema_ready:
                    self._store.ensure_schema(self.config.migrates_itself)
                    self._schema_ready = True
        return self._store

    def dispose_store(self) -> None:
        """In a forked child: never reuse the parent's pooled connections."""
        if self._store is not None:
            self._store.dispose()

    def forget_store(self) -> None:
        """Close the engine and drop the resolved settings: both are read again at next use
        (tests that point an app at another store)."""
        with self._lock:
            self.dispose_store()
            self._store = None
            self._config = None
            self._schema_ready = False
