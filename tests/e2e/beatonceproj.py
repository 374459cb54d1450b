"""The Celery app of ``test_beat_once``: one plain and one resumable task for beat entries.

Configured by environment as ``tests/e2e/beatproj.py`` (RESILIENT_BROKER, RESILIENT_STORE_URL,
RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE, RESILIENT_EFFECT_LOG, RESILIENT_BEAT_PREFIX);
RESILIENT_BEAT_SCHEDULE is JSON: name -> {"every": seconds, "task": "plain" | "resumable"}.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

from celery import Celery, Task

from celery_resilient import Resilient, ResumableTask
from celery_resilient.tasks.task import SCHEDULED_FOR_HEADER
from celery_resilient.testing import EffectLog

BROKER = os.environ.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9")
QUEUE = os.environ.get("RESILIENT_QUEUE", "celery")

app = Celery("beatonceproj", broker=BROKER)
app.conf.update(
    resilient_store_url=os.environ["RESILIENT_STORE_URL"],
    resilient_table_prefix=os.environ.get("RESILIENT_TABLE_PREFIX", "resilient_"),
    task_default_queue=QUEUE,
    timezone="UTC",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    beat_scheduler="celery_resilient.beat:ResilientScheduler",
    beat_max_loop_interval=1,
    redbeat_redis_url=BROKER,
    redbeat_key_prefix=os.environ.get("RESILIENT_BEAT_PREFIX", "redbeat:"),
    redbeat_lock_timeout=6,
    beat_schedule={
        name: {"task": f"tests.e2e.beatonceproj.{spec['task']}_tick",
               "schedule": timedelta(seconds=spec["every"]), "args": (name,),
               "options": {"queue": QUEUE}}
        for name, spec in json.loads(os.environ.get("RESILIENT_BEAT_SCHEDULE", "{}")).items()
    },
)
Resilient(app)
effects = EffectLog(os.environ["RESILIENT_EFFECT_LOG"])


def _record(task: Any, kind: str, entry: str) -> None:
    slot = getattr(task.request, SCHEDULED_FOR_HEADER, None)
    effects.record(f"{kind}:{entry}:{slot}", entry=entry, slot=slot, kind=kind,
                   task_id=task.request.id)


@app.task(bind=True)
def plain_tick(self: Task, entry: str) -> str:
    """A plain task (Celery's default early ack): one effect per run, naming its slot."""
    _record(self, "plain", entry)
    return entry


@app.task(base=ResumableTask, bind=True)
def resumable_tick(self: ResumableTask, entry: str) -> str:
    _record(self, "resumable", entry)
    return entry
