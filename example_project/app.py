"""The example app: an import that checkpoints every row, then two effects that must happen once.

Configured by environment so the demo can point it at its own broker and store:

- ``EXAMPLE_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``)
- ``EXAMPLE_STORE_URL`` (default: celery-resilient's embedded SQLite file in the working dir)
- ``EXAMPLE_EFFECT_LOG`` (default ``example-effects.jsonl``): where effects are witnessed

Run a worker with ``celery -A example_project.app worker -l INFO``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing.effects import EffectLog

app = Celery("example_project",
             broker=os.environ.get("EXAMPLE_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_default_queue=os.environ.get("EXAMPLE_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
if os.environ.get("EXAMPLE_STORE_URL"):
    app.conf.resilient_store_url = os.environ["EXAMPLE_STORE_URL"]
Resilient(app)

effects = EffectLog(os.environ.get("EXAMPLE_EFFECT_LOG", "example-effects.jsonl"))


def import_row(source: str, index: int, delay: float) -> None:
    """Stand-in for reading one row of ``source`` and writing it somewhere (slow on purpose)."""
    time.sleep(delay)
    effects.record("row", source=source, row=index)


def notify_customer(source: str, rows: int) -> str:
    """An effect outside the store (an e-mail, a webhook): a durable step runs it once."""
    effects.record("notify", source=source, rows=rows)
    return f"notified: {rows} rows imported from {source}"


def apply_payment(invoice: str, amount_cents: int) -> dict[str, Any]:
    """A payment-style effect: the idempotency ledger applies it once per invoice key."""
    effects.record("payment", invoice=invoice, amount_cents=amount_cents)
    return {"invoice": invoice, "charged_cents": amount_cents}


@app.task(base=ResumableTask, bind=True)
def import_rows(self: ResumableTask, source: str, rows: int, delay: float = 0.25,
                invoice: str = "INV-1") -> dict[str, Any]:
    """Import ``rows`` rows, checkpointing after each; resumes from the last checkpoint."""
    state = self.checkpoint.load(default={"row": 0})
    effects.record("start", work_key=self.work_key, row=state["row"],
                   checkpoint=self.checkpoint.sequence, attempt=self.attempt)
    for i in range(state["row"], rows):
        import_row(source, i, delay)
        self.checkpoint.save({"row": i + 1})  # durable when it returns
    receipt = self.step("notify", notify_customer, source, rows)
    payment = self.ledger.once(f"payment:{invoice}", apply_payment, invoice, rows * 100)
    return {"rows": rows, "receipt": receipt, "payment": payment}
