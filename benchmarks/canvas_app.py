"""The canvas chaos app: the same tasks as ResumableTask or as plain Celery ``acks_late``.

``CANVAS_MODE`` (``resumable`` or ``plain``), ``CANVAS_REDIS`` (broker and result backend),
``CANVAS_STORE`` and ``CANVAS_PREFIX`` (the store, resumable mode), ``CANVAS_EFFECTS`` (the
effect log: one line per completed body, fsync'd). Plain mode is what a Celery user does for
at-least-once: ``acks_late`` and ``reject_on_worker_lost``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog

MODE = os.environ.get("CANVAS_MODE", "resumable")
REDIS = os.environ.get("CANVAS_REDIS", "redis://127.0.0.1:6379/14")
effects = EffectLog(os.environ.get("CANVAS_EFFECTS", os.devnull))

app = Celery("canvas_app", broker=REDIS, backend=REDIS, set_as_current=False)
app.conf.update(task_default_queue=os.environ.get("CANVAS_QUEUE", "canvas"),
                broker_connection_retry_on_startup=True, result_expires=3600)


class PlainLate(Task):  # type: ignore[misc]
    acks_late = True
    reject_on_worker_lost = True


if MODE == "resumable":
    app.conf.update(resilient_store_url=os.environ["CANVAS_STORE"],
                    resilient_table_prefix=os.environ.get("CANVAS_PREFIX", "resilient_"))
    Resilient(app)
    BASE: type[Task] = ResumableTask
else:
    BASE = PlainLate


@app.task(base=BASE, bind=True, name="cc.add")
def add(self: Task, x: int, y: int, pause: float = 0.0) -> int:
    time.sleep(pause)
    effects.record("add", task_id=self.request.id)
    return x + y


@app.task(base=BASE, bind=True, name="cc.tsum")
def tsum(self: Task, numbers: list[int], tag: str) -> int:
    effects.record("tsum", tag=tag, numbers=sorted(numbers))
    return sum(numbers)


@app.task(base=BASE, bind=True, name="cc.boom")
def boom(self: Task, tag: str, pause: float = 0.0) -> None:
    time.sleep(pause)
    effects.record("boom", tag=tag)
    raise ValueError(f"boom {tag}")


@app.task(base=BASE, bind=True, name="cc.errback")
def errback(self: Task, *args: Any, tag: str) -> None:
    effects.record("errback", tag=tag)
