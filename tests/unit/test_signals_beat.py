"""``slot_caught_up`` is sent by the ResilientScheduler for each missed slot it sends.

An in-process scheduler on the machine's Redis (RedBeat's keys under a prefix of this test's
own, no lock) and an SQLite store whose marker says the last five slots were missed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_resilient import Resilient, signals
from celery_resilient.store.schedule import ScheduleStore


@pytest.fixture
def beat_app(tmp_path: Path, redis_url: str, queue_name: str) -> Iterator[Celery]:
    prefix = f"rb-{uuid.uuid4().hex[:8]}:"
    app = Celery(f"beat-{uuid.uuid4().hex[:6]}", broker=redis_url, set_as_current=False)
    app.conf.update(
        resilient_store_url=f"sqlite:///{tmp_path}/beat.sqlite3", timezone="UTC",
        redbeat_redis_url=redis_url, redbeat_key_prefix=prefix, redbeat_lock_key=None,
        beat_schedule={"every-second": {"task": "proj.tick", "schedule": 1.0,
                                        "options": {"queue": queue_name}}},
    )
    Resilient(app)
    yield app
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(f"{prefix}*"))
        client.delete(*keys, queue_name)
    finally:
        client.close()
        Resilient.of(app).store.dispose()
        app.close()


def test_each_missed_slot_sent_late_sends_slot_caught_up(beat_app: Celery) -> None:
    from celery_resilient.beat import ResilientScheduler

    store = Resilient.of(beat_app).store
    key = f"{beat_app.conf.redbeat_key_prefix}every-second"
    marker = float(int(store.now()) - 5)
    ScheduleStore(store).ensure_markers([(key, marker, None)])
    calls: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        calls.append({"sender": sender, **kwargs})

    signals.slot_caught_up.connect(receiver, weak=False)
    try:
        scheduler = ResilientScheduler(beat_app)
        try:
            scheduler.tick()
        finally:
            scheduler.close()
    finally:
        signals.slot_caught_up.disconnect(receiver)

    sent = [r for r in ScheduleStore(store).runs_of(key) if r.state == "sent"]
    assert len(sent) >= 5
    missed = {r.task_id for r in sent if r.slot <= marker + 5}
    assert len(missed) == 5
    assert {c["task_id"] for c in calls} >= missed  # every missed slot was signalled
    for call in calls:
        assert call["sender"] == call["entry"] == "every-second"
        assert call["app"] is beat_app
        assert call["late_seconds"] > 0
        assert call["slot"].endswith("+00:00")
