"""The public surface a user's code and deployment depend on, pinned: refactors move code,
never these. Additions are welcome (a superset passes); a removal or rename fails here."""

from __future__ import annotations

import dataclasses
import importlib

import celery_resilient
from celery_resilient import signals
from celery_resilient.cli import resilient
from celery_resilient.runtime.config import ResilientConfig

PUBLIC_NAMES = {
    "CheckpointError", "ConfigurationError", "Context", "ContextConflict", "ContextNotFound",
    "ContextStore", "LedgerKeyError", "PayloadTooLarge", "Resilient", "ResilientConfig",
    "ResilientError", "ResumableTask", "SchemaError", "SerializationError", "StaleClaimError",
    "StoreUnavailable", "WorkDead", "WorkKeyConflict", "WorkStopped",
}
SETTINGS = {
    "auto_migrate", "batched_takes", "beat_run_retention", "broker_name", "catchup",
    "catchup_deadline",
    "catchup_grace", "catchup_max_slots", "context_cache_size", "context_cache_ttl",
    "context_cache_url", "context_retention", "durable_submit", "fence_margin",
    "heartbeat_interval", "lease_seconds", "ledger_retention", "liveness_url", "max_attempts",
    "max_checkpoint_bytes", "max_republish", "metrics", "prune_batch", "prune_interval",
    "receipt_buffer_bytes", "reliable_fetch", "republish_backoff_max", "self_fencing",
    "session_liveness", "shutdown", "store_retry_base", "store_retry_max", "store_url",
    "submit_timeout", "sweep_batch", "sweep_interval", "table_prefix", "work_retention",
    "worker_row_retention",
}
SIGNALS = {"duplicate_skipped", "rows_pruned", "slot_caught_up", "work_dead", "work_fenced",
           "work_handed_off", "work_recovered"}
TASK_SURFACE = {"Request", "Strategy", "acks_late", "attempt", "checkpoint", "context",
                "derive_work_key", "execution", "fencing_token", "ledger", "on_replace",
                "on_resume", "reject_on_worker_lost", "resilient", "retry", "scheduled_for",
                "step", "work_key", "apply_async", "delay", "signature"}
CLI = {"migrate": {"as_json"}, "status": {"as_json"},
       "work": {"as_json", "limit", "owner", "states", "task"},
       "recover": {"as_json", "dry_run", "node"},
       "prune": {"as_json", "dry_run", "ledger", "older_than", "yes"},
       "cancel": {"as_json", "dry_run", "older_than", "reason", "states", "task", "work_keys",
                  "yes"},
       "retry": {"as_json", "dry_run", "older_than", "states", "task", "work_keys", "yes"},
       "forget": {"as_json", "dry_run", "older_than", "states", "task", "work_keys", "yes"},
       "schedule": {"as_json", "prefix"}}
#: Paths users name in their configuration (Celery settings, Django, entry points).
CONFIGURED_PATHS = {
    "celery_resilient.beat": "ResilientScheduler",
    "celery_resilient.tasks.request": "ResumableRequest",
    "celery_resilient.tasks.strategy": "resumable",
    "celery_resilient.broker.transport": "Transport",
    "celery_resilient.cli": "resilient",
    "celery_resilient.contrib.flask": "init_app",
    "celery_resilient.testing": "wait_for",
}


def test_every_public_name_is_exported() -> None:
    assert set(celery_resilient.__all__) >= PUBLIC_NAMES
    for name in PUBLIC_NAMES:
        assert getattr(celery_resilient, name) is not None


def test_every_setting_is_read() -> None:
    assert {f.name for f in dataclasses.fields(ResilientConfig)} >= SETTINGS


def test_every_signal_is_sent_from_where_it_was() -> None:
    assert all(hasattr(getattr(signals, name), "connect") for name in SIGNALS)


def test_the_task_base_class_keeps_its_surface() -> None:
    missing = {n for n in TASK_SURFACE if not hasattr(celery_resilient.ResumableTask, n)}
    assert not missing, missing


def test_the_cli_keeps_its_commands_and_options() -> None:
    for name, options in CLI.items():
        command = resilient.commands.get(name)
        assert command is not None, f"celery resilient {name} is gone"
        assert {p.name for p in command.params} >= options, name
    assert "show" in resilient.commands["work"].commands


def test_paths_users_configure_still_import() -> None:
    for module, name in CONFIGURED_PATHS.items():
        assert hasattr(importlib.import_module(module), name), f"{module}:{name}"
