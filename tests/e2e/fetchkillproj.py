"""The app of the random-kill tests (test_fetch_kills.py): short tasks of three kinds, each
recording its start and its end, with pid and fencing token, in the effect log.

- ``work``: a ResumableTask (acks_late, reject_on_worker_lost);
- ``plain_late``: a plain Celery task with acks_late and reject_on_worker_lost;
- ``plain_early``: a plain Celery task with Celery's defaults (acked when it starts).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_resilient import ResumableTask
from celery_resilient.testing import EffectLog

from .envapp import app_from_env


def create_app() -> Celery:
    app = app_from_env("fetchkillproj", os.environ)
    effects = EffectLog(os.environ.get("RESILIENT_EFFECT_LOG", os.devnull))

    @app.task(base=ResumableTask, bind=True, shared=False, name="fetchkill.work")
    def work(self: ResumableTask, n: int, seconds: float) -> int:
        effects.record(f"start:{self.request.id}", epoch=self.fencing_token)
        time.sleep(seconds)
        effects.record(f"end:{self.request.id}", epoch=self.fencing_token)
        return n

    @app.task(bind=True, shared=False, name="fetchkill.plain_late", acks_late=True,
              reject_on_worker_lost=True)
    def plain_late(self: object, n: int, seconds: float) -> int:
        task_id = self.request.id  # type: ignore[attr-defined]
        effects.record(f"start:{task_id}")
        time.sleep(seconds)
        effects.record(f"end:{task_id}")
        return n

    @app.task(bind=True, shared=False, name="fetchkill.plain_early")
    def plain_early(self: object, n: int, seconds: float) -> int:
        task_id = self.request.id  # type: ignore[attr-defined]
        effects.record(f"start:{task_id}")
        time.sleep(seconds)
        effects.record(f"end:{task_id}")
        return n

    return app


app = create_app()
