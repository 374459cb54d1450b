"""The Celery app the e2e tests run in real worker processes (configured by environment).

RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE,
RESILIENT_EFFECT_LOG and optional RESILIENT_EXTRA (JSON of extra app.conf settings).
``create_app`` also builds the same app inside a test process (a client that knows the
task classes, as durable submit needs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from celery import Celery
from sqlalchemy import text

from celery_resilient import ResumableTask, StaleClaimError
from celery_resilient.testing import EffectLog

from .envapp import app_from_env


def create_app(env: Mapping[str, str]) -> Celery:
    app = app_from_env("proj", env)
    effects = EffectLog(env.get("RESILIENT_EFFECT_LOG", os.devnull))

    def charge(work_key: str) -> str:
        effects.record(f"charge:{work_key}")
        return f"receipt-{work_key}"

    def notify(work_key: str) -> str:
        effects.record(f"notify:{work_key}")
        return "sent"

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.ingest")
    def ingest(self: ResumableTask, rows: int, delay: float) -> dict[str, object]:
        """Checkpoints after every row; a step and a ledger effect at the end."""
        state = self.checkpoint.load(default={"row": 0})
        effects.record(f"start:{self.work_key}", row=state["row"], epoch=self.fencing_token)
        for i in range(state["row"], rows):
            time.sleep(delay)
            effects.record(f"row:{self.work_key}:{i}", epoch=self.fencing_token)
            self.checkpoint.save({"row": i + 1})
        receipt = self.step("notify", notify, self.work_key)
        charged = self.ledger.once(f"charge:{self.work_key}", charge, self.work_key)
        return {"rows": rows, "notify": receipt, "charge": charged}

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.sparse")
    def sparse(self: ResumableTask, rows: int, delay: float, every: int) -> int:
        """An effect outside the store every row, a checkpoint only every ``every`` rows, a
        step at the end: the shape that shows two executions running at once."""
        state = self.checkpoint.load(default={"row": 0})
        effects.record(f"start:{self.work_key}", row=state["row"], epoch=self.fencing_token)
        for i in range(state["row"], rows):
            time.sleep(delay)
            effects.record(f"row:{self.work_key}:{i}", epoch=self.fencing_token)
            if (i + 1) % every == 0:
                self.checkpoint.save({"row": i + 1})
        self.step("notify", notify, self.work_key)
        effects.record(f"end:{self.work_key}", epoch=self.fencing_token)
        return rows

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.sleeper")
    def sleeper(self: ResumableTask, seconds: float) -> str:
        """One effect at the start, then a long sleep (outlives a short visibility timeout)."""
        effects.record(f"sleeper:{self.work_key}", epoch=self.fencing_token)
        time.sleep(seconds)
        return "slept"

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.fenced_probe")
    def fenced_probe(self: ResumableTask, rows: int, delay: float) -> str:
        """Checkpoints slowly; a superseded (zombie) run records each write that was refused."""
        key = self.work_key
        state = self.checkpoint.load(default={"row": 0})
        for i in range(state["row"], rows):
            time.sleep(delay)
            try:
                self.checkpoint.save({"row": i + 1})
            except StaleClaimError:
                effects.record(f"refused:checkpoint:{key}", epoch=self.fencing_token)
                break
        # Shared names: a superseded run finds the rescuer's stored results and re-applies
        # nothing. Names of its own (epoch in the name): the write itself must be refused.
        epoch = self.fencing_token
        self.step("probe", effects.record, f"step:{key}")
        self.ledger.once(f"ledger:{key}", effects.record, f"ledger:{key}")
        attempts = {
            "step": lambda: self.step(f"probe-{epoch}", effects.record, f"step:{key}:{epoch}"),
            "ledger": lambda: self.ledger.once(f"ledger:{key}:{epoch}", effects.record,
                                               f"ledger:{key}:{epoch}"),
            "atomic": lambda: _atomic_write(self, effects, key),
        }
        for kind, attempt in attempts.items():
            try:
                attempt()
            except StaleClaimError:
                effects.record(f"refused:{kind}:{key}", epoch=self.fencing_token)
        return f"by-epoch-{self.fencing_token}"

    _register_stream_tasks(app, effects)
    return app


def _register_stream_tasks(app: Celery, effects: EffectLog) -> None:
    """The tasks of the streams of short work (tests/e2e/test_deploys.py)."""
    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.short")
    def short(self: ResumableTask, n: int, blob: str = "") -> int:
        """One effect; ``blob`` only makes the message as big as a test needs."""
        effects.record(f"short:{self.work_key}")
        return n * 2

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.sized")
    def sized(self: ResumableTask, size: int) -> str:
        """One effect, then a result of ``size`` characters."""
        effects.record(f"sized:{self.work_key}")
        return "x" * size

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.held_atomic")
    def held_atomic(self: ResumableTask, until_exists: str) -> str:
        """A ``ledger.atomic()`` block (its work row locked) held until a file exists."""
        with self.ledger.atomic() as tx:
            if not tx.applied:
                tx.execute(text("SELECT 1"))
                effects.record(f"atomic-held:{self.work_key}")
                deadline = time.monotonic() + 120
                while not os.path.exists(until_exists) and time.monotonic() < deadline:
                    time.sleep(0.05)
        effects.record(f"atomic-end:{self.work_key}")
        return "held"

    @app.task(base=ResumableTask, bind=True, shared=False, name="tests.e2e.proj.retried")
    def retried(self: ResumableTask, n: int) -> int:
        """One effect per try; the first try retries in 0.2 s, the second returns."""
        effects.record(f"retried:{self.work_key}:{self.request.retries}")
        if self.request.retries == 0:
            raise self.retry(countdown=0.2, max_retries=1)
        return n


def _atomic_write(task: ResumableTask, effects: EffectLog, key: str) -> None:
    with task.ledger.atomic() as tx:
        if not tx.applied:
            tx.execute(text("SELECT 1"))
            effects.record(f"atomic:{key}")


app = create_app(os.environ)
