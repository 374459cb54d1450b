"""The web side: start an import, look at it, post to a session, show a session (JSON only).

The routes reach the library through the runtime ``init_app`` registered in
``current_app.extensions["celery_resilient"]``: tasks are sent by name, so this module does
not import the tasks (and the worker does not need the routes).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from flask import Blueprint, abort, current_app, request

from celery_resilient import ContextNotFound, ContextStore, Resilient

bp = Blueprint("example", __name__)
TASKS = "example_project.app"


def _runtime() -> Resilient:
    rt: Resilient = current_app.extensions["celery_resilient"]
    return rt


def _contexts() -> ContextStore:
    found = current_app.extensions.get("example_contexts")
    if found is None:
        found = current_app.extensions["example_contexts"] = ContextStore(_runtime().app)
    return found


@bp.post("/imports")
def start_import() -> tuple[dict[str, Any], int]:
    """``{"source": ..., "rows": N, "delay": s, "invoice": ...}`` -> 202 ``{"id": ...}``."""
    body = request.get_json(force=True)
    import_id = str(body.get("id") or f"import-{uuid.uuid4().hex[:8]}")
    _runtime().app.send_task(
        f"{TASKS}.import_rows", args=[body["source"], int(body["rows"])],
        kwargs={"delay": float(body.get("delay", 0.25)),
                "invoice": str(body.get("invoice", f"INV-{import_id}"))},
        task_id=import_id)
    return {"id": import_id}, 202


@bp.get("/imports/<import_id>")
def show_import(import_id: str) -> dict[str, Any]:
    store = _runtime().store
    work = store.get_work(import_id)
    if work is None:
        abort(404)
    checkpoint = store.load_checkpoint(import_id)
    return {"id": import_id, "state": work.state, "attempts": work.attempts,
            "checkpoint": json.loads(checkpoint[0]) if checkpoint else None,
            "result": json.loads(work.result_json) if work.result_json else None}


@bp.post("/sessions/<session>/messages")
def post_message(session: str) -> tuple[dict[str, Any], int]:
    """``{"text": ...}`` -> 202 ``{"task_id": ..., "message_id": ...}``."""
    body = request.get_json(force=True)
    message_id = str(body.get("id") or uuid.uuid4().hex[:8])
    result = _runtime().app.send_task(f"{TASKS}.chat_turn",
                                      args=[session, message_id, str(body["text"])])
    return {"task_id": result.id, "message_id": message_id}, 202


@bp.get("/sessions/<session>")
def show_session(session: str) -> dict[str, Any]:
    try:
        ctx = _contexts().get(f"session:{session}")
    except ContextNotFound:
        abort(404)
    return {"session": session, "version": ctx.version, "messages": ctx["messages"]}
