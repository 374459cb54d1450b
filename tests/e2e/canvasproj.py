"""The app of the canvas kill-point tests: resumable tasks composed into chains and chords,
a Redis result backend (chords count their parts there), effects in the effect log."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery import Celery, chord, group
from celery.backends.redis import RedisBackend

from celery_resilient import ResumableTask
from celery_resilient.core import killpoints
from celery_resilient.testing import EffectLog

from .envapp import app_from_env


class CountKilledRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis backend with the ``before_chord_count`` kill point: SUCCESS or FAILURE
    of a chord header stored, its part not counted yet."""

    def on_chord_part_return(self, request: Any, state: str, result: Any,
                             **kwargs: Any) -> Any:
        if killpoints.ARMED:
            killpoints.reached("before_chord_count")
        return super().on_chord_part_return(request, state, result, **kwargs)


def create_app(env: Mapping[str, str]) -> Celery:
    backend = env.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9")
    if "before_chord_count" in env.get(killpoints.ENV, ""):
        backend = f"{__name__}:CountKilledRedisBackend+{backend}"
    app = app_from_env("canvasproj", env, backend=backend)
    effects = EffectLog(env.get("RESILIENT_EFFECT_LOG", os.devnull))

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.add")
    def add(self: ResumableTask, x: int, y: int) -> int:
        effects.record(f"add:{self.request.id}", epoch=self.fencing_token)
        return x + y

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.tsum")
    def tsum(self: ResumableTask, numbers: list[int]) -> int:
        effects.record(f"tsum:{self.request.id}", numbers=sorted(numbers))
        return sum(numbers)

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.boom")
    def boom(self: ResumableTask, tag: str) -> None:
        effects.record(f"boom:{tag}", epoch=self.fencing_token)
        raise ValueError(f"boom {tag}")

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.replace_by_chord")
    def replace_by_chord(self: ResumableTask) -> None:
        effects.record(f"replacer:{self.request.id}")
        raise self.replace(chord([add.si(1, 2), add.si(3, 4)], tsum.s()))

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.replace_by_group")
    def replace_by_group(self: ResumableTask) -> None:
        effects.record(f"replacer:{self.request.id}")
        raise self.replace(group(add.si(1, 1), add.si(2, 2)))

    @app.task(shared=False, name="canvas.errback")
    def errback(tag: str) -> None:
        effects.record(f"errback:{tag}")

    return app


app = create_app(os.environ)
