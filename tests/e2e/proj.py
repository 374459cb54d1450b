"""The Celery app the e2e tests run in real worker processes (configured by environment).

RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE,
RESILIENT_EFFECT_LOG and optional RESILIENT_EXTRA (JSON of extra app.conf settings).
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery
from sqlalchemy import text

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog

app = Celery("proj", broker=os.environ.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9"))
app.conf.update(
    resilient_store_url=os.environ["RESILIENT_STORE_URL"],
    resilient_table_prefix=os.environ.get("RESILIENT_TABLE_PREFIX", "resilient_"),
    task_default_queue=os.environ.get("RESILIENT_QUEUE", "celery"),
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("RESILIENT_EXTRA", "{}")))
Resilient(app)
effects = EffectLog(os.environ["RESILIENT_EFFECT_LOG"])


def _charge(work_key: str) -> str:
    effects.record(f"charge:{work_key}")
    return f"receipt-{work_key}"


def _notify(work_key: str) -> str:
    effects.record(f"notify:{work_key}")
    return "sent"


@app.task(base=ResumableTask, bind=True)
def ingest(self: ResumableTask, rows: int, delay: float) -> dict[str, object]:
    """Checkpoints after every row; a step and a ledger effect at the end."""
    state = self.checkpoint.load(default={"row": 0})
    effects.record(f"start:{self.work_key}", row=state["row"], epoch=self.fencing_token)
    for i in range(state["row"], rows):
        time.sleep(delay)
        effects.record(f"row:{self.work_key}:{i}", epoch=self.fencing_token)
        self.checkpoint.save({"row": i + 1})
    receipt = self.step("notify", _notify, self.work_key)
    charged = self.ledger.once(f"charge:{self.work_key}", _charge, self.work_key)
    return {"rows": rows, "notify": receipt, "charge": charged}


@app.task(base=ResumableTask, bind=True)
def short(self: ResumableTask, n: int) -> int:
    effects.record(f"short:{self.work_key}")
    return n * 2


@app.task(base=ResumableTask, bind=True)
def sleeper(self: ResumableTask, seconds: float) -> str:
    """One effect at the start, then sleeps in small fenced checkpoints."""
    effects.record(f"sleeper:{self.work_key}", epoch=self.fencing_token)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.1)
    return "slept"


@app.task(base=ResumableTask, bind=True)
def zombie_candidate(self: ResumableTask, rows: int, delay: float) -> str:
    """Checkpoints, a step, a ledger effect and an atomic write: all must be fenced."""
    state = self.checkpoint.load(default={"row": 0})
    for i in range(state["row"], rows):
        effects.record(f"zrow:{self.work_key}:{i}", epoch=self.fencing_token)
        time.sleep(delay)
        self.checkpoint.save({"row": i + 1})
    self.step("zstep", effects.record, f"zstep:{self.work_key}")
    self.ledger.once(f"zcharge:{self.work_key}", effects.record, f"zcharge:{self.work_key}")
    with self.ledger.atomic() as tx:
        if not tx.applied:
            tx.execute(text("SELECT 1"))
            effects.record(f"zatomic:{self.work_key}")
    return f"done-by-{self.fencing_token}"
