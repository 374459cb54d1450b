"""The app of the canvas kill-point tests: resumable tasks composed into chains and chords,
a Redis result backend (chords count their parts there), effects in the effect log."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, chord, group
from celery.backends.redis import CHORD_CLAIM_EXTEND_LUA, RedisBackend

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


class DispatchKilledRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis backend with the ``before_chord_body_sent`` kill point: the chord's
    body claimed for sending (a key that expires), not sent yet."""

    @property
    def _chord_claim_extend_script(self) -> Any:  # looked up just before the body is sent
        if killpoints.ARMED:
            killpoints.reached("before_chord_body_sent")
        return self.client.register_script(CHORD_CLAIM_EXTEND_LUA)


class StoreKilledRedisBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis backend with the ``before_success_stored`` kill point: a success's
    ``link`` callbacks sent (Celery sends them first), its SUCCESS not stored yet."""

    def store_result(self, task_id: str, result: Any, state: str, *args: Any,
                     **kwargs: Any) -> Any:
        if killpoints.ARMED and state == "SUCCESS":
            killpoints.reached("before_success_stored")
        return super().store_result(task_id, result, state, *args, **kwargs)


def create_app(env: Mapping[str, str]) -> Celery:
    backend = env.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9")
    if "before_chord_count" in env.get(killpoints.ENV, ""):
        backend = f"{__name__}:CountKilledRedisBackend+{backend}"
    elif "before_success_stored" in env.get(killpoints.ENV, ""):
        backend = f"{__name__}:StoreKilledRedisBackend+{backend}"
    elif "before_chord_body_sent" in env.get(killpoints.ENV, ""):
        backend = f"{__name__}:DispatchKilledRedisBackend+{backend}"
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

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.replace_by_slow_chord")
    def replace_by_slow_chord(self: ResumableTask, seconds: float) -> None:
        effects.record(f"replacer:{self.request.id}")
        raise self.replace(chord([pause.si(seconds, "h1"), pause.si(seconds, "h2")],
                                 tsum.s()))

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.pause")
    def pause(self: ResumableTask, seconds: float, tag: str) -> int:
        effects.record(f"pause:{tag}", epoch=self.fencing_token)
        time.sleep(seconds)
        return len(tag)

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.replace_by_group")
    def replace_by_group(self: ResumableTask) -> None:
        effects.record(f"replacer:{self.request.id}")
        raise self.replace(group(add.si(1, 1), add.si(2, 2)))

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.retry_once")
    def retry_once(self: ResumableTask, x: int, tag: str) -> int:
        """Retries once, a few seconds later (a kill can land while the retry waits)."""
        if self.request.retries == 0:
            effects.record(f"try:{tag}", epoch=self.fencing_token)
            raise self.retry(countdown=3, max_retries=1)
        effects.record(f"retried:{tag}", epoch=self.fencing_token)
        return x + 10

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.slow")
    def slow(self: ResumableTask, tag: str) -> str:
        effects.record(f"start:{tag}", epoch=self.fencing_token)
        for _ in range(40):
            time.sleep(0.25)
        effects.record(f"end:{tag}", epoch=self.fencing_token)
        return tag

    @app.task(base=ResumableTask, bind=True, shared=False, name="canvas.linked")
    def linked(self: ResumableTask, value: int, tag: str) -> int:
        effects.record(f"linked:{tag}", task_id=self.request.id)
        return value * 10

    @app.task(shared=False, name="canvas.errback")
    def errback(tag: str) -> None:
        effects.record(f"errback:{tag}")

    return app


app = create_app(os.environ)
