"""The app `recovery_time.py` runs: the same slow task, plain Celery or a ResumableTask.

Environment: RECOVERY_MODE (plain | resilient), RECOVERY_BROKER, RECOVERY_QUEUE,
RECOVERY_STORE_URL, RECOVERY_TABLE_PREFIX, RECOVERY_EFFECT_LOG.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing.effects import EffectLog

MODE = os.environ.get("RECOVERY_MODE", "plain")
app = Celery("recovery", broker=os.environ.get("RECOVERY_BROKER", "redis://127.0.0.1:6379/12"))
app.conf.update(task_default_queue=os.environ.get("RECOVERY_QUEUE", "recovery"),
                worker_prefetch_multiplier=4, task_ignore_result=True,
                broker_connection_retry_on_startup=True)
effects = EffectLog(os.environ.get("RECOVERY_EFFECT_LOG", os.devnull))

if MODE == "resilient":
    app.conf.resilient_store_url = os.environ["RECOVERY_STORE_URL"]
    app.conf.resilient_table_prefix = os.environ.get("RECOVERY_TABLE_PREFIX", "resilient_")
    Resilient(app)

    @app.task(name="recovery.slow", base=ResumableTask, bind=True)
    def slow(self: ResumableTask, seconds: float) -> None:
        effects.record(f"start:{self.request.id}", at=time.time())
        time.sleep(seconds)
        effects.record(f"end:{self.request.id}", at=time.time())
else:

    @app.task(name="recovery.slow", bind=True, acks_late=True, reject_on_worker_lost=True)
    def slow(self: object, seconds: float) -> None:  # type: ignore[misc]
        task_id = self.request.id  # type: ignore[attr-defined]
        effects.record(f"start:{task_id}", at=time.time())
        time.sleep(seconds)
        effects.record(f"end:{task_id}", at=time.time())
