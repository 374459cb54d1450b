"""The Celery app of the progress e2e test (configured by environment, as ``proj.py``).

RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE,
RESILIENT_EFFECT_LOG, RESILIENT_EXTRA (JSON of app.conf settings: the result backend).
"""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog, wait_for

app = Celery("progressproj", broker=os.environ.get("RESILIENT_BROKER",
                                                   "redis://127.0.0.1:6379/9"))
app.conf.update(
    resilient_store_url=os.environ["RESILIENT_STORE_URL"],
    resilient_table_prefix=os.environ.get("RESILIENT_TABLE_PREFIX", "resilient_"),
    task_default_queue=os.environ.get("RESILIENT_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
)
app.conf.update(json.loads(os.environ.get("RESILIENT_EXTRA", "{}")))
Resilient(app)
effects = EffectLog(os.environ.get("RESILIENT_EFFECT_LOG", os.devnull))


@app.task(base=ResumableTask, bind=True, name="tests.e2e.progressproj.count")
def count(self: ResumableTask, total: int, pause_at: int, gate: str) -> dict[str, int]:
    """Checkpoints each item with progress; after ``pause_at`` items waits for ``gate``."""
    state = self.checkpoint.load(default={"done": 0})
    resumed_from = state["done"]
    effects.record(f"start:{self.work_key}", done=resumed_from)
    for i in range(resumed_from, total):
        effects.record(f"item:{self.work_key}:{i}")
        self.checkpoint.save({"done": i + 1}, progress=(i + 1, total))
        if i + 1 == pause_at:
            wait_for(lambda: os.path.exists(gate), 120, f"gate {gate}", interval=0.1)
    return {"total": total, "resumed_from": resumed_from}
