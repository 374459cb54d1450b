"""The beat entries as ``celery -A proj resilient schedule`` shows them.

The store keeps, per entry, the last slot sent and its slot records; the next and missed
slots are computed from the entry's RedBeat definition stored with its marker, with the
same window maths beat uses, so what an operator reads is what beat would do.
"""

from __future__ import annotations

from typing import Any

from celery_resilient.beat import windows
from celery_resilient.ops import reports
from celery_resilient.store.admin_queries import EntrySlots
from celery_resilient.store.sql import Store


def default_prefix(app: Any) -> str:
    """The app's ``redbeat_key_prefix``: the entries its beat writes."""
    redbeat_conf = getattr(app, "redbeat_conf", None)
    return str(getattr(redbeat_conf, "key_prefix", "") or "")


def entries(app: Any, store: Store, prefix: str) -> list[dict[str, Any]]:
    """Every entry under ``prefix``, one JSON-shaped row each (a ``note`` says what could
    not be computed)."""
    slots = store.admin.schedule(prefix)
    now = store.now()
    return [entry_json(app, e, now) for e in slots]


def entry_json(app: Any, e: EntrySlots, now: float) -> dict[str, Any]:
    definition = _definition(e.definition_json)
    name = definition.get("name") if isinstance(definition.get("name"), str) else e.entry
    out: dict[str, Any] = {
        "entry": e.entry, "name": name, "task": definition.get("task"),
        "last_slot": reports.iso(e.last_slot), "next_slot": None, "missed": None,
        "pending": e.pending, "oldest_pending_claim": reports.iso(e.oldest_pending_claim),
        "sent": e.sent, "skipped": e.skipped, "last_sent_slot": reports.iso(e.last_sent_slot),
        "note": None,
    }
    try:
        # optional dependency: RedBeat comes with the redis extra
        from redbeat.schedulers import RedBeatSchedulerEntry  # noqa: PLC0415
    except ImportError:
        out["note"] = "next and missed slots need celery-redbeat (extra 'redis')"
        return out
    raw = definition.get("_raw")
    if not isinstance(raw, str):
        out["note"] = "an entry without a stored definition: next and missed slots unknown"
        return out
    try:
        sched = RedBeatSchedulerEntry.decode_definition(raw)["schedule"]
        if hasattr(sched, "app"):
            sched.app = app
        try:
            tz = sched.tz
        except Exception:
            tz = None
        marker = windows.from_seconds(e.last_slot)
        missed = windows.slots_between(sched, marker, windows.from_seconds(now), 1, tz)
        anchor = missed.slots[-1] if missed.slots else marker
        nxt = windows.next_slot(sched, anchor, tz)
    except Exception as exc:  # an unreadable definition must not hide the other entries
        out["note"] = f"a definition could not be read: {type(exc).__name__}: {exc}"
        return out
    out["missed"] = missed.total
    out["next_slot"] = None if nxt is None else reports.iso(windows.to_seconds(nxt))
    return out


def _definition(text: str | None) -> dict[str, Any]:
    """The RedBeat definition inside a marker (``{"static":..., "definition": "<json>"}``)."""
    outer = reports.json_value(text)
    inner = outer.get("definition") if isinstance(outer, dict) else None
    if not isinstance(inner, str):
        return {}
    parsed = reports.json_value(inner)
    result: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    result["_raw"] = inner
    return result


__all__ = ["default_prefix", "entries", "entry_json"]
