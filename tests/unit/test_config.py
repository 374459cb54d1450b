"""ResilientConfig: defaults, coercion, and a clear ConfigurationError for every bad value."""

from __future__ import annotations

import os
from typing import Any

import pytest
from celery import Celery

from celery_resilient import Resilient
from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.config import PREFIX, ResilientConfig
from celery_resilient.store.engine import sanitize_url


def test_defaults_from_an_empty_conf(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = ResilientConfig.from_mapping({})
    assert cfg.store_url == f"sqlite:///{os.path.join(tmp_path, 'celery-resilient.sqlite3')}"
    assert cfg.table_prefix == "resilient_"
    assert cfg.lease_seconds == 30.0
    assert cfg.heartbeat_interval == 5.0
    assert cfg.sweep_interval == 5.0
    assert cfg.max_attempts == 5
    assert cfg.max_checkpoint_bytes == 1_048_576
    assert cfg.durable_submit is False
    assert cfg.catchup == "all"
    assert cfg.catchup_deadline is None
    assert cfg.context_cache_url is None
    assert cfg.auto_migrate is None
    assert cfg.migrates_itself is True  # SQLite migrates itself by default


def test_defaults_from_a_real_celery_app_conf() -> None:
    """app.conf is the mapping Resilient reads; Celery's own keys are not mistaken for ours."""
    app = Celery("cfg-test", broker="memory://", set_as_current=False)
    app.conf.resilient_lease_seconds = 40
    app.conf.resilient_store_url = "postgresql+psycopg://u:p@127.0.0.1/db"
    cfg = ResilientConfig.from_mapping(app.conf)
    assert cfg.lease_seconds == 40.0
    assert cfg.migrates_itself is False  # servers never migrate unless told to


@pytest.mark.parametrize(
    ("url", "auto", "expected"),
    [
        ("sqlite:///x.db", None, True),
        ("sqlite:///x.db", False, False),
        ("postgresql+psycopg://h/db", None, False),
        ("postgresql+psycopg://h/db", True, True),
        ("postgresql+psycopg://h/db", "yes", True),
        ("sqlite:///x.db", "off", False),
    ],
)
def test_auto_migrate(url: str, auto: Any, expected: bool) -> None:
    conf: dict[str, Any] = {"resilient_store_url": url}
    if auto is not None:
        conf["resilient_auto_migrate"] = auto
    assert ResilientConfig.from_mapping(conf).migrates_itself is expected


def test_string_values_are_coerced() -> None:
    cfg = ResilientConfig.from_mapping({
        "resilient_store_url": "sqlite:///x.db",
        "resilient_lease_seconds": "60",
        "resilient_heartbeat_interval": "10.5",
        "resilient_max_attempts": "7",
        "resilient_durable_submit": "true",
        "resilient_catchup": "latest",
        "resilient_catchup_deadline": 300,
    })
    assert (cfg.lease_seconds, cfg.heartbeat_interval, cfg.max_attempts) == (60.0, 10.5, 7)
    assert cfg.durable_submit is True
    assert cfg.catchup == "latest"
    assert cfg.catchup_deadline == 300.0


INVALID: list[tuple[str, Any]] = [
    ("store_url", 42),
    ("store_url", "not-a-url"),
    ("table_prefix", "Bad-Prefix"),
    ("table_prefix", "1starts_with_digit"),
    ("table_prefix", "x" * 32),
    ("table_prefix", 5),
    ("auto_migrate", "maybe"),
    ("auto_migrate", 2),
    ("lease_seconds", 0),
    ("lease_seconds", -1),
    ("lease_seconds", "soon"),
    ("lease_seconds", True),
    ("lease_seconds", [30]),
    ("lease_seconds", "nan"),
    ("lease_seconds", float("nan")),
    ("lease_seconds", float("inf")),
    ("heartbeat_interval", 0),
    ("heartbeat_interval", float("nan")),
    ("sweep_interval", -0.5),
    ("sweep_interval", float("nan")),
    ("max_attempts", 0),
    ("max_attempts", 2.5),
    ("max_attempts", "five"),
    ("max_attempts", True),
    ("max_checkpoint_bytes", 0),
    ("max_checkpoint_bytes", -10),
    ("store_retry_base", 0),
    ("store_retry_max", -1),
    ("durable_submit", "sometimes"),
    ("submit_timeout", 0),
    ("sweep_batch", 0),
    ("catchup", "most"),
    ("catchup", 1),
    ("catchup_max_slots", 0),
    ("catchup_deadline", 0),
    ("catchup_deadline", -5),
    ("context_cache_url", 123),
    ("context_cache_ttl", 0),
    ("context_cache_size", 0),
    ("work_retention", 0),
    ("work_retention", "forever"),
    ("ledger_retention", -1),
    ("ledger_retention", 3600),  # shorter than the work retention (7 days)
    ("worker_row_retention", 0),
    ("prune_interval", 0),
    ("prune_batch", 0),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_every_invalid_value_names_its_key(name: str, value: Any) -> None:
    conf = {"resilient_store_url": "sqlite:///x.db", PREFIX + name: value}
    with pytest.raises(ConfigurationError) as info:
        ResilientConfig.from_mapping(conf)
    assert f"{PREFIX}{name}=" in str(info.value)


def test_unknown_resilient_key_is_rejected_and_known_keys_are_listed() -> None:
    with pytest.raises(ConfigurationError) as info:
        ResilientConfig.from_mapping({"resilient_lease_secs": 10})
    message = str(info.value)
    assert "resilient_lease_secs" in message
    assert "resilient_lease_seconds" in message  # points at the likely intended key


def test_keys_outside_our_prefix_are_ignored() -> None:
    cfg = ResilientConfig.from_mapping({"broker_url": "redis://", "resilience": 1,
                                        "resilient_store_url": "sqlite:///x.db"})
    assert cfg.store_url == "sqlite:///x.db"


def test_heartbeat_more_than_half_the_lease_is_rejected() -> None:
    with pytest.raises(ConfigurationError) as info:
        ResilientConfig.from_mapping({"resilient_store_url": "sqlite:///x.db",
                                      "resilient_lease_seconds": 10,
                                      "resilient_heartbeat_interval": 5.01})
    assert "resilient_heartbeat_interval" in str(info.value)
    assert "half" in str(info.value)


def test_heartbeat_of_exactly_half_the_lease_is_accepted() -> None:
    cfg = ResilientConfig.from_mapping({"resilient_store_url": "sqlite:///x.db",
                                        "resilient_lease_seconds": 10,
                                        "resilient_heartbeat_interval": 5})
    assert cfg.heartbeat_interval * 2 == cfg.lease_seconds


def test_config_is_frozen() -> None:
    cfg = ResilientConfig.from_mapping({"resilient_store_url": "sqlite:///x.db"})
    with pytest.raises(AttributeError):
        cfg.lease_seconds = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg://user:s3cret@db.example:5432/app",
         "postgresql+psycopg://user:***@db.example:5432/app"),
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("amqp://guest:guest@127.0.0.1:5672//", "amqp://guest:***@127.0.0.1:5672//"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("sqlite:////tmp/x.sqlite3", "sqlite:////tmp/x.sqlite3"),
    ],
)
def test_sanitize_url_masks_passwords(url: str, expected: str) -> None:
    assert sanitize_url(url) == expected
    assert "s3cret" not in sanitize_url(url)


def test_unsupported_store_dialect_names_the_key() -> None:
    from celery_resilient.store.sql import Store

    with pytest.raises(ConfigurationError, match="resilient_store_url uses the 'oracle' dialect"):
        Store("oracle://user@127.0.0.1/db")


def test_retention_defaults_and_none_disables() -> None:
    base = {"resilient_store_url": "sqlite:///x.db"}
    cfg = ResilientConfig.from_mapping(base)
    assert (cfg.work_retention, cfg.ledger_retention, cfg.worker_row_retention) == (
        604_800.0, 2_592_000.0, 604_800.0)
    assert (cfg.prune_interval, cfg.prune_batch) == (60.0, 500)
    assert cfg.beat_run_retention == 604_800.0 and cfg.context_retention is None
    off = ResilientConfig.from_mapping({**base, "resilient_work_retention": None,
                                        "resilient_ledger_retention": None,
                                        "resilient_worker_row_retention": None})
    assert (off.work_retention, off.ledger_retention, off.worker_row_retention) == (
        None, None, None)
    app = Celery("cfg-ret", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url="sqlite:///x.db", resilient_worker_row_retention=None)
    assert ResilientConfig.from_mapping(app.conf).worker_row_retention is None


def test_none_keeps_beat_runs_and_means_the_default_elsewhere() -> None:
    base = {"resilient_store_url": "sqlite:///x.db"}
    assert ResilientConfig.from_mapping(
        {**base, "resilient_beat_run_retention": None}).beat_run_retention is None
    cfg = ResilientConfig.from_mapping({**base, "resilient_prune_interval": None,
                                        "resilient_lease_seconds": None})
    assert (cfg.prune_interval, cfg.lease_seconds) == (
        ResilientConfig.prune_interval, ResilientConfig.lease_seconds)
    assert ResilientConfig.from_mapping(
        {**base, "resilient_context_retention": None}).context_retention is None


def test_ledger_retention_must_cover_the_work_retention() -> None:
    base = {"resilient_store_url": "sqlite:///x.db", "resilient_work_retention": 86_400}
    assert ResilientConfig.from_mapping(
        {**base, "resilient_ledger_retention": 86_400}).ledger_retention == 86_400.0
    with pytest.raises(ConfigurationError, match=r"resilient_ledger_retention=.*outlive"):
        ResilientConfig.from_mapping({**base, "resilient_ledger_retention": 3600})
    with pytest.raises(ConfigurationError, match="resilient_ledger_retention"):
        # work kept for ever: a marker must be too
        ResilientConfig.from_mapping({**base, "resilient_work_retention": None})
    cfg = ResilientConfig.from_mapping({**base, "resilient_work_retention": None,
                                        "resilient_ledger_retention": None})
    assert cfg.work_retention is None and cfg.ledger_retention is None


def test_a_misspelt_key_under_a_celery_namespace_is_refused() -> None:
    """``config_from_object(settings, namespace="CELERY")`` (Django's layout): Celery lists
    such keys as written (``CELERY_RESILIENT_...``); a misspelt one must not be ignored."""
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_RESILIENT_STORE_URL = "sqlite:///unused.sqlite3"
        CELERY_RESILIENT_LEASE_SECOND = 10  # lease_seconds, misspelt

    app = Celery("ns-typo", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    with pytest.raises(ConfigurationError, match="CELERY_RESILIENT_LEASE_SECOND"):
        _ = Resilient(app).config
    Settings.CELERY_RESILIENT_LEASE_SECONDS = 12  # type: ignore[attr-defined]
    del Settings.CELERY_RESILIENT_LEASE_SECOND
    app = Celery("ns-ok", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    assert Resilient(app).config.lease_seconds == 12
