"""The Celery app of the deploy e2e tests: a long task that checkpoints every step.

RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE,
RESILIENT_EFFECT_LOG and optional RESILIENT_EXTRA (JSON of extra app.conf settings).

Each execution records ``start`` (the step it resumes at, its pid and fencing token), every
``step`` it performs, and ``end``; a test then checks that executions never overlap in time
and that each step ran exactly once.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_resilient import ResumableTask
from celery_resilient.testing import EffectLog

from .envapp import app_from_env
from .lifecycleproj import result_backend_for

app = app_from_env("deployproj", os.environ, backend=result_backend_for(os.environ))
effects = EffectLog(os.environ.get("RESILIENT_EFFECT_LOG", os.devnull))


@app.task(base=ResumableTask, bind=True, name="tests.e2e.deployproj.long_job", track_started=True)
def long_job(self: ResumableTask, steps: int, delay: float) -> dict[str, Any]:
    state = self.checkpoint.load(default={"i": 0})
    who = {"key": self.work_key, "epoch": self.fencing_token}
    effects.record("start", at=state["i"], **who)
    for i in range(state["i"], steps):
        effects.record("step", i=i, **who)
        time.sleep(delay)
        self.checkpoint.save({"i": i + 1})
    effects.record("end", **who)
    return {"steps": steps}

