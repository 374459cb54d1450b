"""The recovery signals and the Prometheus counters connected to them."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery
from celery.utils.dispatch import Signal
from prometheus_client import REGISTRY, CollectorRegistry

from celery_resilient import ConfigurationError, Resilient, ResilientConfig, signals
from celery_resilient.runtime.metrics import ResilientMetrics

DOCUMENTED = {
    "work_recovered": {"work_key", "task_id", "previous_state", "previous_owner"},
    "duplicate_skipped": {"work_key", "task_id", "task", "reason"},
    "work_fenced": {"work_key", "task_id", "task", "epoch", "error"},
    "work_dead": {"work_key", "task_id", "task", "reason"},
    "slot_caught_up": {"entry", "slot", "task_id", "late_seconds"},
    "work_handed_off": {"work_key", "task_id", "task", "epoch", "republished"},
    "rows_pruned": {"table", "rows"},
}
COUNTERS = {
    "work_recovered": "resilient_work_recovered_total",
    "duplicate_skipped": "resilient_duplicates_skipped_total",
    "work_fenced": "resilient_work_fenced_total",
    "work_dead": "resilient_work_dead_total",
    "slot_caught_up": "resilient_slots_caught_up_total",
    "work_handed_off": "resilient_work_handed_off_total",
    "rows_pruned": "resilient_rows_pruned_total",
}
LABELS = {"slot_caught_up": "entry", "rows_pruned": "table"}


def app_with(**conf: Any) -> Celery:
    app = Celery(f"sig-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url="sqlite:///unused.sqlite3", **conf)
    Resilient(app)
    return app


def test_every_signal_is_a_celery_signal_with_its_documented_arguments() -> None:
    assert {s.name for s in signals.ALL} == set(DOCUMENTED)
    for sig in signals.ALL:
        assert isinstance(sig, Signal)
        assert getattr(signals, sig.name) is sig
        assert sig.providing_args == DOCUMENTED[sig.name] | {"app"}


def test_send_reaches_receivers_filtered_by_sender_with_the_app() -> None:
    app = app_with()
    got: list[tuple[Any, dict[str, Any]]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        got.append((sender, kwargs))

    signals.work_dead.connect(receiver, sender="proj.wanted", weak=False)
    try:
        signals.send(signals.work_dead, app, "proj.other", work_key="k0", task_id="t0",
                     task="proj.other", reason="x")
        signals.send(signals.work_dead, app, "proj.wanted", work_key="k1", task_id="t1",
                     task="proj.wanted", reason="died 5 times")
    finally:
        signals.work_dead.disconnect(receiver, sender="proj.wanted")
    assert len(got) == 1
    sender, kwargs = got[0]
    assert sender == "proj.wanted"
    assert kwargs["app"] is app
    assert (kwargs["work_key"], kwargs["reason"]) == ("k1", "died 5 times")


def test_a_failing_receiver_never_breaks_the_sender() -> None:
    app = app_with()

    def broken(**_: Any) -> None:
        raise RuntimeError("receiver bug")

    signals.work_fenced.connect(broken, weak=False)
    try:
        signals.send(signals.work_fenced, app, "proj.t", work_key="k", task_id="t",
                     task="proj.t", epoch=3, error="superseded")  # must not raise
    finally:
        signals.work_fenced.disconnect(broken)


def test_metrics_count_each_signal_by_task_or_entry() -> None:
    registry = CollectorRegistry()
    metrics = ResilientMetrics(registry).connect()
    app = app_with()
    try:
        for name in DOCUMENTED:
            sig = getattr(signals, name)
            for _ in range(2):
                signals.send(sig, app, f"sender-{name}")
        for name, counter in COUNTERS.items():
            label = LABELS.get(name, "task")
            assert registry.get_sample_value(counter, {label: f"sender-{name}"}) == 2, name
    finally:
        metrics.disconnect()
    signals.send(signals.work_dead, app, "sender-work_dead")
    assert registry.get_sample_value("resilient_work_dead_total",
                                     {"task": "sender-work_dead"}) == 2  # disconnected


def test_resilient_metrics_setting_connects_the_default_registry() -> None:
    task = f"proj.metrics-{uuid.uuid4().hex[:6]}"
    app = app_with(resilient_metrics=True)
    assert app.conf.resilient_metrics is True
    assert Resilient.of(app).config.metrics  # read by every sender before it acts
    signals.send(signals.duplicate_skipped, app, task, work_key="k", task_id="t", task=task,
                 reason="done")
    signals.send(signals.duplicate_skipped, app, task, work_key="k", task_id="t", task=task,
                 reason="done")
    assert REGISTRY.get_sample_value("resilient_duplicates_skipped_total", {"task": task}) == 2


def test_metrics_setting_is_validated() -> None:
    base = {"resilient_store_url": "sqlite:///x.db"}
    assert ResilientConfig.from_mapping({**base, "resilient_metrics": "yes"}).metrics is True
    assert ResilientConfig.from_mapping(base).metrics is False
    with pytest.raises(ConfigurationError, match="resilient_metrics"):
        ResilientConfig.from_mapping({**base, "resilient_metrics": "sometimes"})


def test_rows_pruned_counts_rows_by_table() -> None:
    registry = CollectorRegistry()
    metrics = ResilientMetrics(registry).connect()
    app = app_with()
    try:
        signals.send(signals.rows_pruned, app, "work", table="work", rows=500)
        signals.send(signals.rows_pruned, app, "work", table="work", rows=12)
        signals.send(signals.rows_pruned, app, "steps", table="steps", rows=3)
    finally:
        metrics.disconnect()
    assert registry.get_sample_value("resilient_rows_pruned_total", {"table": "work"}) == 512
    assert registry.get_sample_value("resilient_rows_pruned_total", {"table": "steps"}) == 3
