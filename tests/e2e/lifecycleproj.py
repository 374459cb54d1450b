"""The Celery app of the lifecycle e2e tests: one task per Celery outcome (configured by env).

RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE,
RESILIENT_EFFECT_LOG, RESILIENT_RESULT_BACKEND (default: the broker when it is Redis, else
Redis DB 9) and optional RESILIENT_EXTRA (JSON of extra app.conf settings).

Every task body records ``run:<task id>`` in the effect log when it starts, so a test counts
how many times the body ran, independently of the store.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_resilient import ResumableTask
from celery_resilient.testing import EffectLog

from .envapp import app_from_env

NAME = "tests.e2e.lifecycleproj"
DEFAULT_REDIS = "redis://127.0.0.1:6379/9"
Define = Callable[..., Any]  # task(name, **options): the app's task decorator
Ran = Callable[..., None]    # ran(task, **details): records one run of a body


def result_backend_for(env: Mapping[str, str]) -> str:
    explicit = env.get("RESILIENT_RESULT_BACKEND")
    if explicit:
        return explicit
    broker = env.get("RESILIENT_BROKER", DEFAULT_REDIS)
    return broker if broker.startswith("redis") else DEFAULT_REDIS


def _create_marker(path: str) -> bool:
    """Create ``path``; False when it already existed (the first attempt already passed)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def _sleep_until(seconds: float, gate: str | None) -> None:
    """Sleep ``seconds``, or less when the ``gate`` file appears."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gate is not None and os.path.exists(gate):
            return
        time.sleep(0.05)


def create_app(env: Mapping[str, str]) -> Celery:
    app = app_from_env("lifecycleproj", env, backend=result_backend_for(env))
    effects = EffectLog(env.get("RESILIENT_EFFECT_LOG", os.devnull))

    def ran(task: ResumableTask, **details: Any) -> None:
        """The body started: one line per run, with what the run saw."""
        effects.record(f"run:{task.request.id}", task=task.name.rsplit(".", 1)[-1],
                       epoch=task.fencing_token, attempt=task.attempt,
                       retries=task.request.retries, **details)

    def task(name: str, **options: Any) -> Any:
        return app.task(base=options.pop("base", ResumableTask), bind=True, shared=False,
                        name=f"{NAME}.{name}", **options)

    _body_outcomes(task, ran)
    _stops_and_limits(task, ran)
    _deaths(task, ran, effects)
    return app


def _body_outcomes(task: Define, ran: Ran) -> None:
    """Outcomes the body itself decides: return, raise, retry, Ignore, Reject."""

    @task("succeed")
    def succeed(self: ResumableTask, n: int) -> int:
        ran(self)
        return n * 2

    @task("boom")
    def boom(self: ResumableTask) -> None:
        ran(self)
        raise ValueError("boom")

    @task("retry_always", max_retries=1)
    def retry_always(self: ResumableTask) -> None:
        """self.retry every time: max_retries=1 means two runs, then the exception."""
        ran(self)
        raise self.retry(exc=ValueError(f"still failing after {self.request.retries}"),
                         countdown=0.2)

    @task("retry_then_ok", max_retries=3)
    def retry_then_ok(self: ResumableTask) -> dict[str, int]:
        """Checkpoints, then retries once: the retry resumes from the checkpoint."""
        state = self.checkpoint.load(default={"tries": 0})
        ran(self, seen=state["tries"])
        if state["tries"] < 1:
            self.checkpoint.save({"tries": state["tries"] + 1})
            raise self.retry(countdown=0.2)
        return {"tries": state["tries"], "retries": self.request.retries}

    @task("autoretry", autoretry_for=(ValueError,), retry_backoff=1, retry_backoff_max=1,
          retry_jitter=False, max_retries=2)
    def autoretry(self: ResumableTask, fail_times: int) -> int:
        ran(self)
        if self.request.retries < fail_times:
            raise ValueError(f"flaky attempt {self.request.retries}")
        return int(self.request.retries)

    @task("ignored")
    def ignored(self: ResumableTask) -> None:
        ran(self)
        raise Ignore()

    @task("reject_requeue")
    def reject_requeue(self: ResumableTask, marker: str) -> str:
        """Rejects (requeue=True) its first delivery; the second delivery succeeds."""
        first = _create_marker(marker)
        ran(self, first=first)
        if first:
            raise Reject("first delivery rejected", requeue=True)
        return "second delivery"

    @task("reject_drop")
    def reject_drop(self: ResumableTask) -> None:
        ran(self)
        raise Reject("dropped", requeue=False)

    class KeyedByLabel(ResumableTask):
        """A logical work key from the first argument (``derive_work_key``)."""

        def derive_work_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            return f"label:{args[0]}"

    @task("retry_new_args", base=KeyedByLabel, max_retries=3)
    def retry_new_args(self: ResumableTask, label: str) -> str:
        """Retries once with another argument, so the retry derives another work key."""
        ran(self, key=self.work_key)
        if self.request.retries == 0:
            raise self.retry(args=(f"{label}-v2",), countdown=0.2)
        return label

    @task("labelled", base=KeyedByLabel)
    def labelled(self: ResumableTask, label: str, n: int) -> int:
        """One unit of work per label, whatever the task id (a logical work key)."""
        ran(self, key=self.work_key)
        return n

    @task("replacer")
    def replacer(self: ResumableTask, n: int) -> None:
        """Replaces itself with ``succeed(n)``, which runs under this task id."""
        ran(self)
        raise self.replace(self.app.signature(f"{NAME}.succeed", args=(n,), immutable=True))


def _stops_and_limits(task: Define, ran: Ran) -> None:
    """Outcomes decided outside the body: revoke, expires, time limits."""

    @task("sleeper")
    def sleeper(self: ResumableTask, seconds: float, gate: str | None = None) -> str:
        """Sleeps ``seconds`` (or until ``gate`` exists): keeps a concurrency-1 worker busy."""
        ran(self)
        _sleep_until(seconds, gate)
        return "slept"

    @task("expiring", expires=3)
    def expiring(self: ResumableTask) -> str:
        """Sent through ``apply_async``, its messages expire 3 s after they were sent."""
        ran(self)
        return "ran before it expired"

    @task("soft_limit", soft_time_limit=1)
    def soft_limit(self: ResumableTask) -> str:
        ran(self)
        time.sleep(20)  # SoftTimeLimitExceeded is raised in here after 1 s
        return "not reached"

    @task("soft_limit_in_store", soft_time_limit=1)
    def soft_limit_in_store(self: ResumableTask, use_steps: bool) -> str:
        """Checkpoints (or steps) in a tight loop: its soft limit most likely lands while a
        store statement waits for the server."""
        ran(self)
        i = 0
        while True:
            i += 1
            if use_steps:
                self.step(f"s{i}", lambda n=i: n)
            else:
                self.checkpoint.save({"i": i})

    @task("hard_limit", time_limit=2)
    def hard_limit(self: ResumableTask) -> str:
        ran(self)
        time.sleep(30)  # the pool process is killed after 2 s
        return "not reached"


def _deaths(task: Define, ran: Ran, effects: EffectLog) -> None:
    """Work whose process dies: resumed from its checkpoint, or refused by its resume hook."""

    class ResumeFails(ResumableTask):
        """A task whose resume hook cannot cope: a resumed attempt must end ``failed``."""

        def on_resume(self, attempt: int) -> None:
            effects.record(f"resume:{self.request.id}", attempt=attempt)
            raise RuntimeError(f"cannot resume (attempt {attempt})")

    @task("resume_fails", base=ResumeFails)
    def resume_fails(self: ResumableTask, marker: str) -> str:
        """The first attempt SIGKILLs its own pool process; the resumed one never runs."""
        ran(self)
        if _create_marker(marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return "ran again"

    @task("checkpointed")
    def checkpointed(self: ResumableTask, rows: int, delay: float) -> dict[str, int]:
        """Checkpoints after every row; a resumed run starts at the saved row."""
        state = self.checkpoint.load(default={"row": 0})
        ran(self, seen=state["row"])
        for i in range(state["row"], rows):
            time.sleep(delay)
            effects.record(f"row:{self.request.id}:{i}", epoch=self.fencing_token)
            self.checkpoint.save({"row": i + 1})
        return {"rows": rows, "resumed_from": state["row"]}


app = create_app(os.environ)
