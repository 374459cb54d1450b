"""The Celery app the beat e2e tests run under ``celery beat`` and ``celery worker``.

Configured by environment: RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX,
RESILIENT_QUEUE, RESILIENT_EFFECT_LOG, RESILIENT_BEAT_PREFIX (RedBeat key prefix),
RESILIENT_BEAT_REDIS (RedBeat's Redis, default the broker),
RESILIENT_BEAT_SCHEDULE (JSON: name -> {"every": seconds, "options": {...}}) and optional
RESILIENT_EXTRA (JSON of extra app.conf settings).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog

BROKER = os.environ.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9")
QUEUE = os.environ.get("RESILIENT_QUEUE", "celery")

app = Celery("beatproj", broker=BROKER)
app.conf.update(
    resilient_store_url=os.environ["RESILIENT_STORE_URL"],
    resilient_table_prefix=os.environ.get("RESILIENT_TABLE_PREFIX", "resilient_"),
    task_default_queue=QUEUE,
    timezone="UTC",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    beat_scheduler="celery_resilient.beat:ResilientScheduler",
    beat_max_loop_interval=1,
    redbeat_redis_url=os.environ.get("RESILIENT_BEAT_REDIS", BROKER),
    redbeat_key_prefix=os.environ.get("RESILIENT_BEAT_PREFIX", "redbeat:"),
    redbeat_lock_timeout=6,
    beat_schedule={
        name: {"task": "tests.e2e.beatproj.tick", "schedule": timedelta(seconds=spec["every"]),
               "args": (name,), "options": {"queue": QUEUE, **spec.get("options", {})}}
        for name, spec in json.loads(os.environ.get("RESILIENT_BEAT_SCHEDULE", "{}")).items()
    },
)
app.conf.update(json.loads(os.environ.get("RESILIENT_EXTRA", "{}")))
Resilient(app)
effects = EffectLog(os.environ["RESILIENT_EFFECT_LOG"])


@app.task(base=ResumableTask, bind=True)
def tick(self: ResumableTask, entry: str) -> str:
    """One effect per run, naming the slot it serves: the witness for "each slot once"."""
    slot = self.scheduled_for
    effects.record(f"tick:{entry}:{slot.isoformat() if slot else None}",
                   entry=entry, slot=slot.isoformat() if slot else None,
                   task_id=self.request.id, work_key=self.work_key)
    return entry
