"""The Celery app of the context e2e tests, run in real worker processes (configured by env).

Same environment as ``tests/e2e/proj.py`` (RESILIENT_BROKER, RESILIENT_STORE_URL,
RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE, RESILIENT_EFFECT_LOG, RESILIENT_EXTRA), plus
RESILIENT_CTX_PAUSE, a kill point for the first attempt of ``turn``: ``in_update`` stops
inside the store transaction, after the context UPDATE ran and before it commits;
``after_commit`` stops right after the commit, before the cache is updated.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from sqlalchemy import Engine, event

from celery_resilient import ContextConflict, Resilient, ResumableTask
from celery_resilient.testing import EffectLog, wait_for

app = Celery("ctxproj", broker=os.environ.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9"))
app.conf.update(
    resilient_store_url=os.environ["RESILIENT_STORE_URL"],
    resilient_table_prefix=os.environ.get("RESILIENT_TABLE_PREFIX", "resilient_"),
    task_default_queue=os.environ.get("RESILIENT_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
app.conf.update(json.loads(os.environ.get("RESILIENT_EXTRA", "{}")))
Resilient(app)
effects = EffectLog(os.environ["RESILIENT_EFFECT_LOG"])
PAUSE = os.environ.get("RESILIENT_CTX_PAUSE", "")
FIELDS = 40
_armed = {"turn": False, "committed": False}


def _pause(point: str) -> None:
    effects.record(f"paused:{point}")
    time.sleep(120)  # the test SIGKILLs the worker here


@event.listens_for(Engine, "after_cursor_execute")
def _in_update(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
    if _armed["turn"] and statement.lstrip().upper().startswith("UPDATE") \
            and "contexts" in statement:
        if PAUSE == "in_update":
            _pause("in_update")
        _armed["committed"] = PAUSE == "after_commit"


@event.listens_for(Engine, "checkin")
def _after_commit(*args: Any) -> None:
    if _armed["committed"]:
        _pause("after_commit")


def _payload(turn: str) -> dict[str, str]:
    """Many fields written together: a torn write would mix two turns."""
    return {f"f{i}": turn for i in range(FIELDS)}


@app.task(base=ResumableTask, bind=True)
def open_session(self: ResumableTask, session: str) -> int:
    ctx = self.context(session, create_default={"turns": ["t0"], "payload": _payload("t0")})
    return ctx.version


@app.task(base=ResumableTask, bind=True)
def turn(self: ResumableTask, session: str, name: str) -> dict[str, Any]:
    """Append ``name`` to the session once (idempotent on retry) and rewrite the payload."""
    ctx = self.context(session)
    effects.record(f"seen:{name}", version=ctx.version, turns=list(ctx["turns"]),
                   payload=sorted(set(ctx["payload"].values())), attempt=self.attempt)
    if name not in ctx["turns"]:
        ctx["turns"].append(name)
        ctx["payload"] = _payload(name)
        _armed["turn"] = bool(PAUSE) and self.attempt == 1
        try:
            ctx.save()
        finally:
            _armed["turn"] = _armed["committed"] = False
    return {"version": ctx.version, "turns": ctx["turns"]}


@app.task(base=ResumableTask, bind=True)
def race(self: ResumableTask, session: str, name: str, peers: int) -> int:
    """Read, wait until ``peers`` tasks have read, then write: all but one conflict."""
    ctx = self.context(session)
    effects.record(f"read:{name}", version=ctx.version)
    wait_for(lambda: sum(1 for e in effects.entries() if e["effect"].startswith("read:"))
             >= peers, 30, f"{peers} tasks to read the context")
    ctx["turns"].append(name)
    try:
        return ctx.save()
    except ContextConflict:
        effects.record(f"conflict:{name}", version=ctx.version)
        raise self.retry(countdown=0.2, max_retries=5) from None
