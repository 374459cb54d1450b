"""Read-only views of stored work, as ``celery -A proj resilient work`` shows them.

Each view is taken with the store's own clock (``now``), so a lease's time left and an age
read the same whichever host asks. The JSON shapes are the CLI's ``--json`` output; a script
or an admin page that needs the same view calls these instead of querying the store itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_resilient.ops import reports
from celery_resilient.store.admin_queries import WorkDetail
from celery_resilient.store.sql import Store, WorkInfo


@dataclass(frozen=True)
class WorkList:
    """Work matching a filter, most recently changed first, and the store's time."""

    rows: list[WorkInfo]
    now: float


@dataclass(frozen=True)
class WorkView:
    """One unit of work with its checkpoint, steps and ledger, and the store's time."""

    detail: WorkDetail
    now: float


def list_work(store: Store, states: Sequence[str], task: str | None, owner: str | None,
              limit: int) -> WorkList:
    rows = store.admin.list_work(states, task, owner, limit)
    return WorkList(rows, store.now())


def show_work(store: Store, work_key: str) -> WorkView | None:
    """The unit stored under ``work_key``, or None when there is none."""
    detail = store.admin.work_detail(work_key)
    if detail is None:
        return None
    return WorkView(detail, store.now())


def work_json(w: WorkInfo, now: float) -> dict[str, Any]:
    return {
        "work_key": w.work_key, "task": w.task_name, "task_id": w.task_id, "state": w.state,
        "epoch": w.epoch, "owner": w.owner_node, "incarnation": w.incarnation,
        "pid": w.owner_pid,
        "lease_expires_at": reports.iso(w.lease_expires_at),
        "lease_left_s": None if w.lease_expires_at is None
        else round(w.lease_expires_at - now, 1),
        "attempts": w.attempts, "deaths": w.deaths, "republished": w.republished,
        "has_message": w.has_message, "error": w.error,
        "created_at": reports.iso(w.created_at), "updated_at": reports.iso(w.updated_at),
        "finished_at": reports.iso(w.finished_at),
    }


def work_view_json(view: WorkView) -> dict[str, Any]:
    """:func:`work_json` with the result, checkpoint, steps, ledger and message route."""
    detail = view.detail
    w, cp = detail.work, detail.checkpoint
    data = work_json(w, view.now)
    data.update({
        "result": reports.json_value(w.result_json),
        "checkpoint": None if cp is None else {
            "seq": cp.seq, "epoch": cp.epoch, "updated_at": reports.iso(cp.updated_at),
            "state": reports.json_value(cp.state_json)},
        "steps": [{"name": s.name, "epoch": s.epoch, "at": reports.iso(s.created_at),
                   "result": reports.json_value(s.result_json)} for s in detail.steps],
        "ledger": [{"key": x.key, "epoch": x.epoch, "applied_at": reports.iso(x.applied_at)}
                   for x in detail.ledger],
        "message": None if detail.message_route is None else {
            "exchange": detail.message_route[0], "routing_key": detail.message_route[1]},
    })
    return data


__all__ = ["WorkList", "WorkView", "list_work", "show_work", "work_json", "work_view_json"]
