"""The Celery app of the chaos soak (``benchmarks/chaos.py``), configured by environment.

CHAOS_BROKER, CHAOS_STORE_URL, CHAOS_TABLE_PREFIX, CHAOS_QUEUE, RESILIENT_EFFECT_LOG and
optional CHAOS_EXTRA (JSON of extra app.conf settings).

Every task records what it does in the effect log (an fsync'd line per effect, written by the
process that did it, with its pid and a wall-clock ``ts``), independent of the store: the soak
checks the store against it. Every execution records ``start`` first and ``end`` when its body
returns, each line naming the work key and the execution's fencing token (``epoch``), so the
soak can check that no two executions of one unit overlap in time.

A fenced write that the store refuses (``StaleClaimError``: a newer execution owns the work) is
recorded as ``refused``; one that found the store down as ``unavailable``; a checkpoint after
which the worker's warm shutdown took the work away as ``handoff``. A refused write is the
fence doing its job and is the only line of an execution allowed after its successor started;
every other line (an effect, a committed checkpoint) is the execution running.

- ``long``: checkpoints after every row; logs ``start`` (the row it resumed from), each
  ``row`` (the effect, before its checkpoint) and each checkpoint it wrote (``cp``, after
  ``save`` returned); then one step and one ``ledger.once`` effect.
- ``short``: one effect outside the store.
- ``steps``: three steps, each with an effect outside the store.
- ``poison`` (not in the soak's mix): kills its own process every time it runs;
  ``poison_worker`` kills its whole worker.
- ``atomic``: a write of its own to the store's database inside ``ledger.atomic()``: the
  table ``<prefix>chaos_applied`` (no unique key, so a double write would show).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table

from celery_resilient import Resilient, ResumableTask, StaleClaimError, StoreUnavailable
from celery_resilient.core.handoff import HandOff
from celery_resilient.testing import EffectLog


def applied_table(prefix: str) -> Table:
    return Table(f"{prefix}chaos_applied", MetaData(),
                 Column("work_key", String(255), nullable=False),
                 Column("epoch", Integer, nullable=False))


def record_effect(effects: EffectLog, name: str, key: str, epoch: int, **details: Any) -> int:
    effects.record(name, key=key, epoch=epoch, **details)
    return epoch  # the stored result names the epoch whose effect was recorded


@contextmanager
def recorded_write(effects: EffectLog, key: str, epoch: int, write: str) -> Iterator[None]:
    """Record how a fenced write of an execution ended when it did not simply commit."""
    try:
        yield
    except StaleClaimError:
        effects.record("refused", key=key, epoch=epoch, write=write)
        raise
    except StoreUnavailable:
        effects.record("unavailable", key=key, epoch=epoch, write=write)
        raise
    except HandOff:  # the checkpoint committed; the warm shutdown takes the work away
        effects.record("handoff", key=key, epoch=epoch, write=write)
        raise


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

    effect = functools.partial(record_effect, effects)
    fenced = functools.partial(recorded_write, effects)

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.long")
    def long(self: ResumableTask, rows: int, delay: float) -> dict[str, int]:
        key, epoch = self.work_key, self.fencing_token
        with fenced(key, epoch, "load"):
            state = self.checkpoint.load(default={"row": 0})
        effects.record("start", key=key, epoch=epoch, row=state["row"])
        for i in range(state["row"], rows):
            time.sleep(delay)
            effects.record("row", key=key, epoch=epoch, row=i)
            with fenced(key, epoch, f"cp {i + 1}"):
                seq = self.checkpoint.save({"row": i + 1})
            effects.record("cp", key=key, epoch=epoch, row=i + 1, seq=seq)
        with fenced(key, epoch, "step finish"):
            step = self.step("finish", effect, "step", key, epoch, step="finish")
        with fenced(key, epoch, "ledger charge"):
            charge = self.ledger.once(f"charge:{key}", effect, "ledger", key, epoch)
        effects.record("end", key=key, epoch=epoch)
        return {"rows": rows, "step": step, "ledger": charge}

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.short")
    def short(self: ResumableTask, n: int, delay: float) -> int:
        for line in ("start", "short"):  # the effect is the first thing it does
            effects.record(line, key=self.work_key, epoch=self.fencing_token)
        time.sleep(delay)
        effects.record("end", key=self.work_key, epoch=self.fencing_token)
        return n * 2

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.steps")
    def steps(self: ResumableTask, delay: float) -> list[int]:
        key, epoch = self.work_key, self.fencing_token
        effects.record("start", key=key, epoch=epoch)
        done = []
        for name in ("a", "b", "c"):
            time.sleep(delay)
            with fenced(key, epoch, f"step {name}"):
                done.append(self.step(name, effect, "step", key, epoch, step=name))
        effects.record("end", key=key, epoch=epoch)
        return done

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.atomic")
    def atomic(self: ResumableTask, delay: float) -> str:
        key, epoch = self.work_key, self.fencing_token
        effects.record("start", key=key, epoch=epoch)
        time.sleep(delay)
        with fenced(key, epoch, "atomic"), self.ledger.atomic() as tx:
            if not tx.applied:
                tx.execute(applied.insert().values(work_key=key, epoch=epoch))
                tx.result = epoch
        effects.record("end", key=key, epoch=epoch)
        return "ok"

    _poisons(app, effects)
    return app


def _poisons(app: Celery, effects: EffectLog) -> None:
    """Messages that kill what runs them, every time (not in the soak's mix)."""

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.poison")
    def poison(self: ResumableTask) -> None:
        """SIGKILLs the pool process running it."""
        effects.record("poison", key=self.work_key, epoch=self.fencing_token)
        os.kill(os.getpid(), signal.SIGKILL)

    @app.task(base=ResumableTask, bind=True, shared=False, name="chaos.poison_worker")
    def poison_worker(self: ResumableTask, delay: float) -> None:
        """SIGKILLs its whole worker (process group), ``delay`` s in."""
        effects.record("poison_worker", key=self.work_key, epoch=self.fencing_token)
        time.sleep(delay)
        os.killpg(os.getpgid(0), signal.SIGKILL)


app = create_app(os.environ)
