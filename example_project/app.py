"""The example project: a Flask app with a Celery worker and beat using every guarantee.

- ``import_rows``: an import that checkpoints every row, then notifies the customer through a
  durable step (an effect outside the store) and applies a payment through the ledger;
- ``rollup``: a periodic job (beat, every ``EXAMPLE_BEAT_EVERY`` seconds) on
  ``ResilientScheduler``, so slots missed while beat was down are caught up, each once, each
  knowing its own ``scheduled_for``;
- ``chat_turn``: appends a message to a session's continuity context (``self.context``),
  cached in Redis, durable in the store.

The Flask app (``flask_app``, routes in ``web.py``) configures the library through
``resilient.init_app(flask_app)`` from its ``RESILIENT_*`` keys. The worker and beat import
this module too, so they build the same Flask app and read the same settings.

Configured by environment so the demo can point it at its own broker and store:

- ``EXAMPLE_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``)
- ``EXAMPLE_STORE_URL`` (default: celery-resilient's embedded SQLite file in the working dir)
- ``EXAMPLE_EFFECT_LOG`` (default ``example-effects.jsonl``): where effects are witnessed
- ``EXAMPLE_QUEUE`` (default ``celery``), ``EXAMPLE_BEAT_PREFIX`` (RedBeat key prefix, default
  ``example_project:``), ``EXAMPLE_BEAT_EVERY`` (seconds between rollups, default 2)

Run ``celery -A example_project.app worker -l INFO``, ``celery -A example_project.app beat
-l INFO`` and ``flask --app example_project.app:flask_app run``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from celery import Celery
from flask import Flask

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing.effects import EffectLog

BROKER = os.environ.get("EXAMPLE_BROKER_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("EXAMPLE_QUEUE", "celery")

app = Celery("example_project", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    timezone="UTC",
    # beat: RedBeat with durable slots and catch-up of missed ones
    beat_scheduler="celery_resilient.beat:ResilientScheduler",
    beat_max_loop_interval=1,
    redbeat_redis_url=BROKER,
    redbeat_key_prefix=os.environ.get("EXAMPLE_BEAT_PREFIX", "example_project:"),
    beat_schedule={
        "rollup": {"task": "example_project.app.rollup",
                   "schedule": timedelta(seconds=float(os.environ.get("EXAMPLE_BEAT_EVERY", "2"))),
                   "options": {"queue": QUEUE}},
    },
)
resilient = Resilient(app)
effects = EffectLog(os.environ.get("EXAMPLE_EFFECT_LOG", "example-effects.jsonl"))


def create_app() -> Flask:
    """The web app; its ``RESILIENT_*`` config becomes the library's settings."""
    from .web import bp

    flask_app = Flask(__name__)
    flask_app.config.update(
        RESILIENT_CATCHUP="all",  # run every slot beat missed (the default, said out loud)
        RESILIENT_CONTEXT_CACHE_TTL=3600,
    )
    if os.environ.get("EXAMPLE_STORE_URL"):
        flask_app.config["RESILIENT_STORE_URL"] = os.environ["EXAMPLE_STORE_URL"]
    resilient.init_app(flask_app)
    flask_app.register_blueprint(bp)
    return flask_app


# -- the import: a checkpoint per row, a durable step, a ledger-protected payment ------------

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


# -- the periodic job: one run per slot, missed slots caught up --------------------------------

@app.task(base=ResumableTask, bind=True)
def rollup(self: ResumableTask) -> str | None:
    """Roll up the period ending at this run's slot (``self.scheduled_for``, not "now")."""
    slot = self.scheduled_for
    stamp = slot.isoformat() if slot else None
    effects.record("rollup", scheduled_for=stamp, work_key=self.work_key,
                   task_id=self.request.id)
    return stamp


# -- the session: a continuity context shared by tasks ----------------------------------------

def session_key(session: str) -> str:
    return f"session:{session}"


@app.task(base=ResumableTask, bind=True)
def chat_turn(self: ResumableTask, session: str, message_id: str, text: str) -> dict[str, Any]:
    """Append one message to the session (once, even if this task runs again)."""
    ctx = self.context(session_key(session), create_default={"messages": []})
    effects.record("turn", session=session, message_id=message_id, seen_version=ctx.version,
                   seen=[m["id"] for m in ctx["messages"]])
    if all(m["id"] != message_id for m in ctx["messages"]):
        ctx["messages"].append({"id": message_id, "text": text})
        ctx.save()  # compare-and-set on the version read, fenced by this execution's claim
    return {"version": ctx.version, "messages": len(ctx["messages"])}


flask_app = create_app()
