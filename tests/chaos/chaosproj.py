"""The Celery app of the chaos soak (``benchmarks/chaos.py``), configured by environment.

CHAOS_BROKER, CHAOS_STORE_URL, CHAOS_TABLE_PREFIX, CHAOS_QUEUE, RESILIENT_EFFECT_LOG and
optional CHAOS_EXTRA (JSON of extra app.conf settings).

Every task records what it does in the effect log (an fsync'd line per effect, written by the
process that did it), independent of the store: the soak checks the store against it.

- ``long``: checkpoints after every row; logs ``start`` (the row it resumed from), each
  ``row`` and each checkpoint it wrote (``cp``, after ``save`` returned); then one step and
  one ``ledger.once`` effect.
- ``short``: one effect outside the store.
- ``steps``: three steps, each with an effect outside the store.
- ``poison`` (not in the soak's mix): kills its own process every time it runs.
- ``atomic``: a write of its own to the store's database inside ``ledger.atomic()``: the
  table ``<prefix>chaos_applied`` (no unique key, so a double write would show).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog


def applied_table(prefix: str) -> Table:
    return Table(f"{prefix}chaos_applied", MetaData(),
                 Column("work_key", String(255), nullable=False),
                 Column("epoch", Integer, nullable=False))


def create_app(env: Mapping[str, str]) -> Celery:
    prefix = env.get("CHAOS_TABLE_PREFIX", "resilient_")
    app = Celery("chaosproj", broker=env.get("CHAOS_BROKER", "redis://127.0.0.1:6379/9"),
                 set_as_current=False)
    app.conf.update(
        resilient_store_url=env.get("CHAOS_STORE_URL") or None,
        resilient_table_prefix=prefix,
        task_default_queue=env.get("CHAOS_QUEUE", "celery"),
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=4,
    )
    app.conf.update(json.loads(env.get("CHAOS_EXTRA", "{}")))
    Resilient(app)
    effects = EffectLog(env.get("RESILIENT_EFFECT_LOG", os.devnull))
    applied = applied_table(prefix)

    def effect(name: str, key: str, epoch: int, **details: Any) -> int:
        effects.record(name, key=key, epoch=epoch, **details)
        return epoch  # the stored result names the epoch whose effect was recorded

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.long")
    def long(self: ResumableTask, rows: int, delay: float) -> dict[str, int]:
        key, epoch = self.work_key, self.fencing_token
        state = self.checkpoint.load(default={"row": 0})
        effects.record("start", key=key, epoch=epoch, row=state["row"])
        for i in range(state["row"], rows):
            time.sleep(delay)
            effects.record("row", key=key, epoch=epoch, row=i)
            seq = self.checkpoint.save({"row": i + 1})
            effects.record("cp", key=key, epoch=epoch, row=i + 1, seq=seq)
        step = self.step("finish", effect, "step", key, epoch, step="finish")
        charge = self.ledger.once(f"charge:{key}", effect, "ledger", key, epoch)
        return {"rows": rows, "step": step, "ledger": charge}

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.short")
    def short(self: ResumableTask, n: int, delay: float) -> int:
        effects.record("short", key=self.work_key, epoch=self.fencing_token)
        time.sleep(delay)
        return n * 2

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.steps")
    def steps(self: ResumableTask, delay: float) -> list[int]:
        key, epoch = self.work_key, self.fencing_token
        done = []
        for name in ("a", "b", "c"):
            time.sleep(delay)
            done.append(self.step(name, effect, "step", key, epoch, step=name))
        return done

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.atomic")
    def atomic(self: ResumableTask, delay: float) -> str:
        key, epoch = self.work_key, self.fencing_token
        time.sleep(delay)
        with self.ledger.atomic() as tx:
            if not tx.applied:
                tx.execute(applied.insert().values(work_key=key, epoch=epoch))
                tx.result = epoch
        return "ok"

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.poison")
    def poison(self: ResumableTask) -> None:
        """A poison message: SIGKILLs the process running it, every time."""
        effects.record("poison", key=self.work_key, epoch=self.fencing_token)
        os.kill(os.getpid(), signal.SIGKILL)

    return app


app = create_app(os.environ)
