"""A Flask project whose Celery app is configured through ``Resilient(celery).init_app``.

Run by real ``celery worker`` processes in the Flask tests. Configured the Flask way, from
environment variables with the ``FLASKPROJ_`` prefix (``flask_app.config.from_prefixed_env``):
``FLASKPROJ_RESILIENT_STORE_URL``, ``FLASKPROJ_RESILIENT_TABLE_PREFIX``, ``FLASKPROJ_BROKER``,
``FLASKPROJ_QUEUE`` and ``FLASKPROJ_GREETING``; ``RESILIENT_EFFECT_LOG`` names the effect log.

``count`` uses Flask's documented ``FlaskTask`` pattern (a ``Task`` subclass whose ``__call__``
runs ``self.run`` inside an app context) combined with ``ResumableTask``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task
from flask import Flask, current_app

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog

flask_app = Flask("flaskproj")
flask_app.config.from_prefixed_env("FLASKPROJ")

celery_app = Celery("flaskproj", broker=flask_app.config.get("BROKER", "redis://127.0.0.1:6379/9"),
                    set_as_current=False)
celery_app.conf.update(task_default_queue=flask_app.config.get("QUEUE", "celery"),
                       broker_connection_retry_on_startup=True)
resilient = Resilient(celery_app)
resilient.init_app(flask_app)
effects = EffectLog(os.environ.get("RESILIENT_EFFECT_LOG", os.devnull))


@celery_app.task(base=ResumableTask, bind=True, shared=False, name="flaskproj.greet")
def greet(self: ResumableTask, names: list[str]) -> list[str]:
    """Checkpoints after every name; reads the Flask config inside an app context."""
    state = self.checkpoint.load(default={"done": []})
    done: list[str] = state["done"]
    with flask_app.app_context():
        greeting = current_app.config["GREETING"]
    for name in names[len(done):]:
        effects.record(f"greet:{self.work_key}:{name}")
        done.append(f"{greeting}, {name}")
        self.checkpoint.save({"done": done})
    return done


class FlaskTask(Task):  # type: ignore[misc]
    """Flask's documented pattern (flask.palletsprojects.com, "Background Tasks with Celery")."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with flask_app.app_context():
            return self.run(*args, **kwargs)


class FlaskResumableTask(FlaskTask, ResumableTask):
    """The Flask pattern with ResumableTask: the claim is taken around FlaskTask.__call__."""


@celery_app.task(base=FlaskResumableTask, bind=True, shared=False, name="flaskproj.count")
def count(self: ResumableTask, n: int, delay: float) -> dict[str, Any]:
    """Counts to ``n``, checkpointing each step; ``current_app`` without opening a context."""
    state = self.checkpoint.load(default={"i": 0})
    effects.record(f"start:{self.work_key}", i=state["i"])
    for i in range(state["i"], n):
        effects.record(f"step:{self.work_key}:{i}")
        time.sleep(delay)
        self.checkpoint.save({"i": i + 1})
    return {"n": n, "greeting": current_app.config["GREETING"]}
