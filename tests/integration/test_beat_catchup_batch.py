"""A large catch-up cut in the middle of a batch: no slot lost, none started twice.

The scheduler claims every missed slot in one transaction, publishes them on one producer and
records them sent per ``SEND_BATCH`` slots. Cut it after part of a batch was published:

- a real SIGKILL of a beat process (the ``RESILIENT_BEAT_KILL_AFTER_PUBLISH`` kill point, in
  the middle of the second batch): the restarted beat re-sends every claimed, unrecorded slot
  with its task id. The slots published but not recorded exist twice in the broker (at most
  one batch of them, exactly those) and the worker's once-check starts each slot once;
- a broker error in the middle of a batch: what was published is recorded sent, the rest is
  re-sent by the next beat; nothing is published twice.

Real Redis (broker), SQLite and PostgreSQL stores; the beat runs without RedBeat's lock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_resilient import Resilient
from celery_resilient.beat import ResilientScheduler
from celery_resilient.beat.scheduler import (
    KILL_AFTER_PUBLISH_ENV,
    KILL_AFTER_PUBLISH_NTH_ENV,
    SEND_BATCH,
    task_id_for,
)
from celery_resilient.beat.windows import from_seconds, to_seconds, to_us
from celery_resilient.store.schedule import CLAIMED, SENT, ScheduleStore
from celery_resilient.store.sql import Store

SLOTS = 1200  # three batches: 500 + 500 + 200
KILL_AT = SEND_BATCH + 200  # the 700th publish: 200 slots of the second batch unrecorded
ENTRY = "every-second"

APP_SOURCE = """
import json, os
from celery import Celery
from celery_resilient import Resilient

cfg = json.loads(os.environ["BATCH_TEST_CONFIG"])
app = Celery("batch-" + cfg["prefix"], broker=cfg["broker"], set_as_current=False)
app.conf.update(
    resilient_store_url=cfg["store"], resilient_table_prefix=cfg["tables"],
    resilient_catchup_max_slots=5000, task_default_queue=cfg["queue"], timezone="UTC",
    redbeat_redis_url=cfg["broker"], redbeat_key_prefix=cfg["prefix"], redbeat_lock_key=None,
    beat_schedule={"every-second": {"task": "batch.noop", "schedule": 1.0}},
)
Resilient(app)
"""


class Setup:
    def __init__(self, store_url: str, table_prefix: str, redis_url: str, queue: str) -> None:
        self.config = {"store": store_url, "tables": table_prefix, "broker": redis_url,
                       "queue": queue, "prefix": f"rb-{uuid.uuid4().hex[:8]}:"}
        self.store = Store(store_url, table_prefix)
        self.store.migrate()
        self.slots = ScheduleStore(self.store)
        self.redis = redis.Redis.from_url(redis_url)
        self.apps: list[Celery] = []

    @property
    def key(self) -> str:
        return self.config["prefix"] + ENTRY

    def miss(self, count: int) -> float:
        """The entry's marker: ``count`` one-second slots (and half a second) ago."""
        now = to_us(Celery(set_as_current=False).now())
        marker = to_seconds(now - count * 1_000_000 - 500_000)
        self.slots.ensure_markers([(self.key, marker, None)])
        return marker

    def app(self) -> Celery:
        namespace: dict[str, Any] = {}
        os.environ["BATCH_TEST_CONFIG"] = json.dumps(self.config)
        try:
            exec(APP_SOURCE, namespace)  # the same app as the beat subprocess
        finally:
            del os.environ["BATCH_TEST_CONFIG"]
        app: Celery = namespace["app"]
        self.apps.append(app)
        return app

    def messages(self) -> list[dict[str, Any]]:
        """Headers of every message in the queue."""
        raw = self.redis.lrange(self.config["queue"], 0, -1)
        return [json.loads(m)["headers"] for m in raw]

    def close(self) -> None:
        keys = list(self.redis.scan_iter(match=f"{self.config['prefix']}*", count=1000))
        self.redis.delete(self.config["queue"], *keys)
        self.redis.close()
        for app in self.apps:
            Resilient.of(app).store.dispose()
            app.close()
        self.store.dispose()


@pytest.fixture
def setup(store_url: str, table_prefix: str, redis_url: str,
          queue_name: str) -> Iterator[Setup]:
    s = Setup(store_url, table_prefix, redis_url, queue_name)
    yield s
    s.close()


def _tick(app: Celery) -> None:
    scheduler = ResilientScheduler(app)
    try:
        scheduler.tick()
    finally:
        scheduler.close()


def _check_each_slot_once(s: Setup, marker: float) -> Counter[str]:
    """Every slot after the marker has one row, recorded sent, and at least one message with
    its own task id; the once-check (``ScheduleStore.start``, as a worker runs it for each
    delivery) starts each slot exactly once however many copies the broker holds."""
    rows = s.slots.runs_of(s.key)
    slots = [r.slot for r in rows]
    assert slots[0] == pytest.approx(marker + 1) and len(slots) >= SLOTS
    assert all(b - a == pytest.approx(1.0) for a, b in pairwise(slots)), \
        "a slot is missing"
    assert {r.state for r in rows} == {SENT}, Counter(r.state for r in rows)
    by_id = {r.task_id: r.slot for r in rows}
    assert all(r.task_id == task_id_for(s.key, from_seconds(r.slot)) for r in rows)
    copies = Counter(h["id"] for h in s.messages())
    assert set(copies) == set(by_id), "a slot was never published, or a stranger was"
    starts: Counter[str] = Counter()
    for i, headers in enumerate(s.messages()):
        slot = by_id[headers["id"]]
        assert headers["resilient_beat_entry"] == s.key
        scheduled_for = datetime.fromisoformat(headers["resilient_scheduled_for"])
        assert to_us(scheduled_for) == from_seconds(slot)
        if s.slots.start(s.key, slot, headers["id"], f"worker-{i}").started:
            starts[headers["id"]] += 1
    assert set(starts) == set(by_id) and set(starts.values()) == {1}, "a slot started twice"
    return copies


def test_sigkill_mid_batch_resends_unrecorded_slots_and_each_starts_once(
        setup: Setup, tmp_path: Path) -> None:
    marker = setup.miss(SLOTS)
    script = tmp_path / "beat_once.py"
    script.write_text(APP_SOURCE + textwrap.dedent("""
        from celery_resilient.beat import ResilientScheduler
        ResilientScheduler(app).tick()
        raise SystemExit("the kill point did not fire")
    """))
    killed = tmp_path / "killed"
    env = {**os.environ, "BATCH_TEST_CONFIG": json.dumps(setup.config),
           KILL_AFTER_PUBLISH_ENV: str(killed), KILL_AFTER_PUBLISH_NTH_ENV: str(KILL_AT)}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert killed.exists()

    rows = setup.slots.runs_of(setup.key)
    assert len(rows) >= SLOTS, "every missed slot was claimed before the first publish"
    recorded = [r.slot for r in rows if r.state == SENT]
    unrecorded = [r.slot for r in rows if r.state == CLAIMED]
    assert len(recorded) == SEND_BATCH, "the first batch was recorded sent, no more"
    assert max(recorded) < min(unrecorded)
    before = Counter(h["id"] for h in setup.messages())
    assert len(before) == sum(before.values()) == KILL_AT, "published once each, in order"

    _tick(setup.app())  # the next beat: reconcile re-sends the claimed rows, then catches up

    copies = _check_each_slot_once(setup, marker)
    twice = sorted(r.slot for r in setup.slots.runs_of(setup.key) if copies[r.task_id] > 1)
    assert twice == unrecorded[:KILL_AT - SEND_BATCH], \
        "exactly the published, unrecorded part of the cut batch exists twice"
    assert max(copies.values()) == 2


def test_broker_error_mid_batch_records_what_was_published(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = setup.miss(SLOTS)
    app = setup.app()
    real = ResilientScheduler._sender
    published = 0

    def failing_sender(self: ResilientScheduler, entry: Any, producer: Any) -> Any:
        send = real(self, entry, producer)

        def flaky(slot: int, task_id: str, scheduled_for: str) -> None:
            nonlocal published
            if published == KILL_AT:
                raise ConnectionError("broker went away")
            send(slot, task_id, scheduled_for)
            published += 1

        return flaky

    monkeypatch.setattr(ResilientScheduler, "_sender", failing_sender)
    _tick(app)
    monkeypatch.undo()
    rows = setup.slots.runs_of(setup.key)
    assert sum(r.state == SENT for r in rows) == KILL_AT, "every published slot recorded"
    assert sum(r.state == CLAIMED for r in rows) == len(rows) - KILL_AT

    _tick(setup.app())  # the next beat sends the rest

    copies = _check_each_slot_once(setup, marker)
    assert set(copies.values()) == {1}, "nothing was published twice"
