"""proj/celery.py of docs/django.md, word for word, plus one resumable task."""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_resilient import Resilient, ResumableTask

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.contrib.django.djproj.settings")
app = Celery("djproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
Resilient(app)


@app.task(base=ResumableTask, bind=True, name="djproj.ingest")
def ingest(self: ResumableTask, rows: int, delay: float) -> dict[str, int]:
    """Checkpoints after every row; records where each execution started."""
    state = self.checkpoint.load(default={"row": 0, "starts": []})
    starts = [*state["starts"], state["row"]]
    for i in range(state["row"], rows):
        time.sleep(delay)
        self.checkpoint.save({"row": i + 1, "starts": starts})
    return {"rows": rows, "resumed_at": starts[-1], "executions": len(starts)}
