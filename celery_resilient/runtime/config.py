"""Typed settings, read once from ``app.conf`` (``resilient_*`` keys).

Every setting is documented in ``docs/configuration.md``; an invalid value raises
:class:`ConfigurationError` naming the key, at startup rather than mid-task.
"""

from __future__ import annotations

import atexit
import importlib.util
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from celery_resilient.errors import ConfigurationError

PREFIX = "resilient_"
_TABLE_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
CATCHUP_POLICIES = ("all", "latest", "skip")
SHUTDOWN_MODES = ("hand_off", "drain")
#: Retention settings whose default is a duration and that ``None``, set explicitly, disables.
NONE_DISABLES = ("work_retention", "ledger_retention", "worker_row_retention",
                 "beat_run_retention")


def default_store_url(conf: Mapping[str, Any] | None = None) -> str:
    """The store when no ``resilient_store_url`` is set.

    For workers, an SQLite file in the working directory: durable across restarts, zero
    setup. For an app in eager mode (``task_always_eager``, which runs tests and scripts, not
    workers), a fresh SQLite file in a temporary directory removed when the process exits:
    eager runs never write into the working directory nor see an earlier run's work.
    """
    if conf is not None and conf.get("task_always_eager"):  # truthy, as Celery reads it
        return f"sqlite:///{_temporary_store_path()}"
    path = os.path.abspath("celery-resilient.sqlite3")
    return f"sqlite:///{path}"


def _temporary_store_path() -> str:
    # A file, not ":memory:": SQLAlchemy gives each thread its own in-memory database, and
    # eager tasks may be applied from several threads of one test process.
    folder = tempfile.mkdtemp(prefix="celery-resilient-eager-")
    atexit.register(shutil.rmtree, folder, True)
    return os.path.join(folder, "store.sqlite3")


@dataclass(frozen=True)
class ResilientConfig:
    """Resolved settings. Field ``x`` is read from ``app.conf.resilient_x``."""

    store_url: str = ""
    table_prefix: str = "resilient_"
    auto_migrate: bool | None = None
    lease_seconds: float = 30.0
    heartbeat_interval: float = 5.0
    #: PostgreSQL: each incarnation holds a session-level advisory lock, so a successor or a
    #: sweeper proves it dead as soon as its session ends (celery_resilient.store.liveness).
    session_liveness: bool = True
    #: Where that session connects (a direct URL when the store URL goes through a pooler
    #: in transaction mode); None: the store URL.
    liveness_url: str | None = None
    #: Stop this worker's resumable executions once its lease went unrenewed for
    #: ``lease_seconds - fence_margin``; None: one ``heartbeat_interval``.
    fence_margin: float | None = None
    #: False: a worker that may have lost its work keeps running it (only the store's epochs
    #: refuse its writes); its executions may then overlap with a successor's.
    self_fencing: bool = True
    sweep_interval: float = 5.0
    max_attempts: int = 5
    max_checkpoint_bytes: int = 1_048_576
    receipt_buffer_bytes: int = 67_108_864
    store_retry_base: float = 1.0
    store_retry_max: float = 60.0
    durable_submit: bool = False
    #: Names the broker when workers reach one broker through different addresses (NAT, a
    #: proxy): workers of one store on different brokers refuse to start side by side
    #: (celery_resilient.broker.identity), judged by address unless this is set.
    broker_name: str | None = None
    #: On a Redis broker, the worker consumes through
    #: :mod:`celery_resilient.broker.transport` (an atomic fetch into a holding that the
    #: store's judgement of who is gone gives back), unless ``broker_transport`` is set.
    reliable_fetch: bool = True
    #: A prefork worker's main process takes the claims of many deliveries in one statement
    #: before the pool runs them (worker/dispatch/); False: each pool process takes its own.
    batched_takes: bool = True
    submit_timeout: float = 60.0
    sweep_batch: int = 500
    max_republish: int = 8
    republish_backoff_max: float = 3600.0
    #: Warm shutdown: "hand_off" (running resumable work moves to another worker at its
    #: next checkpoint) or "drain" (Celery's: wait for it, leases kept alive meanwhile).
    shutdown: str = "hand_off"
    catchup: str = "all"
    catchup_max_slots: int = 1000
    catchup_deadline: float | None = None
    catchup_grace: float = 30.0
    beat_run_retention: float | None = 604_800.0
    context_cache_url: str | None = None
    context_cache_ttl: float = 86_400.0
    context_cache_size: int = 10_000
    context_retention: float | None = None
    #: Automatic retention (the worker's maintainer, see docs/operations.md). ``None``
    #: (set explicitly) keeps those rows for ever.
    work_retention: float | None = 604_800.0
    #: The exactly-once horizon: a replay of an effect after its marker is pruned runs again.
    ledger_retention: float | None = 2_592_000.0
    worker_row_retention: float | None = 604_800.0
    prune_interval: float = 60.0
    prune_batch: int = 500
    metrics: bool = False

    @property
    def fence_after(self) -> float:
        """Seconds without a lease renewal after which this worker stops its executions."""
        margin = self.heartbeat_interval if self.fence_margin is None else self.fence_margin
        return self.lease_seconds - margin

    @property
    def renewal_deadline(self) -> float:
        """Seconds a lease renewal or liveness ping may go unanswered before it counts as
        lost and is made again on a fresh connection (a store that stays connected and
        answers nothing never ends it otherwise): room for two tries before the fence."""
        return max(1.0, min(max(2.0, self.heartbeat_interval), self.fence_after / 2))

    @property
    def store_deadline(self) -> float:
        """Seconds any one background store operation (a flush, a sweep, a prune) may go
        unanswered before it counts as failed and is retried."""
        return max(10.0, self.lease_seconds)

    @property
    def liveness_target(self) -> str | None:
        """The URL of the liveness session, or None when the proof is off or impossible."""
        url = self.liveness_url or self.store_url
        if not self.session_liveness or not url.startswith(("postgresql", "mysql", "mariadb")):
            return None
        return url

    @property
    def migrates_itself(self) -> bool:
        """SQLite stores migrate on first use unless told not to; servers never do."""
        if self.auto_migrate is not None:
            return self.auto_migrate
        return self.store_url.startswith("sqlite")

    @classmethod
    def from_mapping(cls, conf: Mapping[str, Any], namespace: str | None = None) -> ResilientConfig:
        """``namespace``: the app's Celery settings namespace (``config_from_object(...,
        namespace="CELERY")``), whose keys (``CELERY_RESILIENT_LEASE_SECONDS``) are checked
        too, so a misspelt one is refused as in ``app.conf``."""
        values: dict[str, Any] = {}
        known = {f.name for f in fields(cls)}
        written = f"{namespace}_{PREFIX}".upper() if namespace else None
        for key in conf:
            if not isinstance(key, str):
                continue
            if key.startswith(PREFIX):
                name = key[len(PREFIX):]
            elif written is not None and key.startswith(written):
                name = key[len(written):].lower()
            else:
                continue
            if name not in known:
                raise ConfigurationError(
                    f"Unknown setting {key!r}; known settings: "
                    + ", ".join(sorted(PREFIX + k for k in known))
                )
        for f in fields(cls):
            key = PREFIX + f.name
            value = conf.get(key)
            if value is None:
                # None, set explicitly, keeps rows for ever where a retention allows it; for
                # any other setting it means its default, as if unset (test fixtures put
                # back an unset setting as None).
                if f.name in NONE_DISABLES and key in conf:
                    values[f.name] = None
                continue
            values[f.name] = _coerce(key, value, _CHECKS.get(f.name))
        config = cls(**values)
        if not config.store_url:
            config = _replace(config, store_url=default_store_url(conf))
        config.validate()
        return config

    def validate(self) -> None:
        def bad(name: str, why: str) -> ConfigurationError:
            value = getattr(self, name)
            return ConfigurationError(f"{PREFIX}{name}={value!r} is invalid: {why}")

        if not _TABLE_PREFIX_RE.match(self.table_prefix):
            raise bad("table_prefix", "use lowercase letters, digits and _ (max 31 chars)")
        for name in ("lease_seconds", "heartbeat_interval", "sweep_interval", "submit_timeout",
                     "store_retry_base", "store_retry_max", "context_cache_ttl",
                     "republish_backoff_max"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be a positive number of seconds")
        if self.heartbeat_interval * 2 > self.lease_seconds:
            raise bad(
                "heartbeat_interval",
                f"must be at most half of resilient_lease_seconds ({self.lease_seconds}) "
                "so one missed heartbeat does not expire a live worker's leases",
            )
        if self.fence_margin is not None and not (
                0 < self.fence_margin <= self.lease_seconds - self.heartbeat_interval):
            raise bad("fence_margin", "must be positive and leave at least one "
                      f"resilient_heartbeat_interval ({self.heartbeat_interval}s) of the lease "
                      f"({self.lease_seconds}s) to renew it in")
        if self.liveness_url is not None and "://" not in self.liveness_url:
            raise bad("liveness_url", "must be an SQLAlchemy URL such as "
                      "postgresql+psycopg://host/db")
        for name in ("max_attempts", "max_checkpoint_bytes", "sweep_batch", "max_republish",
                     "catchup_max_slots", "context_cache_size", "receipt_buffer_bytes"):
            if getattr(self, name) < 1:
                raise bad(name, "must be a positive integer")
        if self.shutdown not in SHUTDOWN_MODES:
            raise bad("shutdown", f"must be one of {', '.join(SHUTDOWN_MODES)}")
        if self.catchup not in CATCHUP_POLICIES:
            raise bad("catchup", f"must be one of {', '.join(CATCHUP_POLICIES)}")
        if self.catchup_deadline is not None and self.catchup_deadline <= 0:
            raise bad("catchup_deadline", "must be a positive number of seconds or None")
        if self.context_cache_url is not None and not self.context_cache_url.startswith(
                ("redis://", "rediss://", "unix://", "memory://")):
            raise bad("context_cache_url", "use a redis://, rediss:// or unix:// URL, or "
                      "memory:// for an in-process cache")
        if self.context_retention is not None and self.context_retention <= 0:
            raise bad("context_retention", "must be a positive number of seconds or None")
        for name in ("catchup_grace", "prune_interval"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be a positive number of seconds")
        for name in NONE_DISABLES:
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise bad(name, "must be a positive number of seconds, or None to keep rows")
        if self.prune_batch < 1:
            raise bad("prune_batch", "must be a positive integer")
        if self.ledger_retention is not None and (
                self.work_retention is None or self.ledger_retention < self.work_retention):
            raise bad("ledger_retention",
                      f"must be at least resilient_work_retention ({self.work_retention}), "
                      "or None: a ledger marker must outlive the work whose effect it guards")
        if self.metrics and importlib.util.find_spec("prometheus_client") is None:
            raise bad("metrics", "needs prometheus-client: pip install "
                      "'celery-resilient[prometheus]'")
        if "://" not in self.store_url:
            raise bad("store_url", "must be an SQLAlchemy URL such as sqlite:///path.db")


def _replace(config: ResilientConfig, **changes: Any) -> ResilientConfig:
    data = {f.name: getattr(config, f.name) for f in fields(config)}
    data.update(changes)
    return ResilientConfig(**data)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected a boolean")


def _as_positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("expected an integer")
    return int(value)


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a number")
    number = float(value)
    if not math.isfinite(number):  # nan passes every `<= 0` check; inf never expires
        raise ValueError("expected a finite number")
    return number


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "store_url": _as_str,
    "table_prefix": _as_str,
    "auto_migrate": _as_bool,
    "lease_seconds": _as_float,
    "heartbeat_interval": _as_float,
    "session_liveness": _as_bool,
    "liveness_url": _as_str,
    "fence_margin": _as_float,
    "self_fencing": _as_bool,
    "sweep_interval": _as_float,
    "max_attempts": _as_positive_int,
    "max_checkpoint_bytes": _as_positive_int,
    "receipt_buffer_bytes": _as_positive_int,
    "store_retry_base": _as_float,
    "store_retry_max": _as_float,
    "durable_submit": _as_bool,
    "broker_name": _as_str,
    "reliable_fetch": _as_bool,
    "batched_takes": _as_bool,
    "submit_timeout": _as_float,
    "sweep_batch": _as_positive_int,
    "max_republish": _as_positive_int,
    "republish_backoff_max": _as_float,
    "catchup": _as_str,
    "shutdown": _as_str,
    "catchup_max_slots": _as_positive_int,
    "catchup_deadline": _as_float,
    "catchup_grace": _as_float,
    "beat_run_retention": _as_float,
    "context_cache_url": _as_str,
    "context_cache_ttl": _as_float,
    "context_cache_size": _as_positive_int,
    "context_retention": _as_float,
    "work_retention": _as_float,
    "ledger_retention": _as_float,
    "worker_row_retention": _as_float,
    "prune_interval": _as_float,
    "prune_batch": _as_positive_int,
    "metrics": _as_bool,
}


def _coerce(key: str, value: Any, check: Callable[[Any], Any] | None) -> Any:
    if check is None:
        return value
    try:
        return check(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{key}={value!r} is invalid: {exc}") from None
