"""Reports shared by ``celery -A proj resilient`` and Django's ``manage.py`` commands.

One implementation, one JSON shape and one exit code for ``status`` and ``migrate``, and the
one way every command names the store it uses (password masked).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from celery_resilient.core.states import ALL_STATES, DEAD, OPEN_STATES
from celery_resilient.errors import ResilientError
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store import migrate as migrations
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.sql import Store


def describe_store(cfg: ResilientConfig) -> str:
    """The store as every command names it: URL with the password masked, and the prefix."""
    return f"{sanitize_url(cfg.store_url)} (prefix {cfg.table_prefix})"


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def json_value(text: str | None) -> Any:
    """Stored JSON decoded for a report; text that is not JSON is shown as it is."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    delta = now - ts
    word = "ago" if delta >= 0 else "from now"
    return f"{span(abs(delta))} {word}"


def span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86_400:.1f}d"


def rows(echo: Callable[[str], Any], headers: Sequence[str], rows: Sequence[Sequence[Any]],
          indent: str = "  ") -> None:
    if not rows:
        echo(f"{indent}(none)")
        return
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    echo(indent + "  ".join(h.upper().ljust(w) for h, w in zip(headers, widths,
                                                               strict=True)).rstrip())
    for r in cells:
        echo(indent + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


MAX_OPEN = 50


def _store_error(cfg: ResilientConfig, exc: BaseException) -> str:
    return f"the store {describe_store(cfg)} could not be used: {type(exc).__name__}: {exc}"


def migrate_report(cfg: ResilientConfig) -> tuple[dict[str, Any], int]:
    """Bring the schema of ``cfg``'s store to the head revision: (report, exit code).

    The report is ``{"store", "table_prefix", "before", "revision", "head", "changed"}``,
    or ``{"store", "table_prefix", "error"}`` with exit code 1 when the store cannot be used.
    """
    data: dict[str, Any] = {"store": sanitize_url(cfg.store_url),
                            "table_prefix": cfg.table_prefix}
    store = Store(cfg.store_url, cfg.table_prefix)
    try:
        before = migrations.current_revision(store.engine, cfg.table_prefix)
        store.migrate()
        info = migrations.describe(store.engine, cfg.table_prefix)
    except (ResilientError, SQLAlchemyError) as exc:
        data["error"] = _store_error(cfg, exc)
        return data, 1
    finally:
        store.dispose()
    data.update(before=before, revision=info["current"], head=info["head"],
                changed=before != info["current"])
    return data, 0


def migrate_text(data: dict[str, Any]) -> str:
    change = ("already current" if not data["changed"]
              else f"upgraded from {data['before'] or 'nothing'}")
    return (f"schema of {data['store']} (prefix {data['table_prefix']}) is at revision "
            f"{data['revision']} ({change})")


def status_report(cfg: ResilientConfig, migrate_command: str) -> tuple[dict[str, Any], int]:
    """The status of ``cfg``'s store: (report, exit code 0, or 1 with an ``error`` key).

    One implementation and one JSON shape for ``celery -A proj resilient status`` and
    ``manage.py resilient_status``. The schema is created or upgraded first only where a
    worker would do it itself (``ResilientConfig.migrates_itself``); otherwise a missing or
    old schema is the error, naming ``migrate_command``.
    """
    data: dict[str, Any] = {"store": sanitize_url(cfg.store_url),
                            "table_prefix": cfg.table_prefix}
    store = Store(cfg.store_url, cfg.table_prefix)
    try:
        schema = migrations.describe(store.engine, cfg.table_prefix)
        if schema["current"] != schema["head"] and cfg.migrates_itself:
            store.migrate()  # as the first worker would
            schema = migrations.describe(store.engine, cfg.table_prefix)
        data["schema"] = schema
        if schema["current"] != schema["head"]:
            state = ("missing" if schema["current"] is None
                     else f"at revision {schema['current']}, expected {schema['head']}")
            data["error"] = (f"the schema of the store {describe_store(cfg)} is {state}: "
                             f"run `{migrate_command}`")
            return data, 1
        data.update(_status_data(store))
    except (ResilientError, SQLAlchemyError) as exc:
        data["error"] = _store_error(cfg, exc)
        return data, 1
    finally:
        store.dispose()
    return data, 0


def _status_data(store: Store) -> dict[str, Any]:
    s = store.admin.status()
    now = s.now
    open_rows = [w for st in OPEN_STATES for w in store.list_work(state=st, limit=MAX_OPEN)]
    open_rows.sort(key=lambda w: (w.lease_expires_at is None, w.lease_expires_at or 0.0))
    oldest = None if s.oldest_lease is None else {
        "work_key": s.oldest_lease[0], "expires_at": iso(s.oldest_lease[1]),
        "left_s": round(s.oldest_lease[1] - now, 1)}
    return {
        "now": iso(now),
        "work": s.by_state,
        "open_by_owner": [{"state": st, "owner": o, "count": n} for st, o, n in s.by_owner],
        "open": [{"work_key": w.work_key, "task": w.task_name, "state": w.state,
                  "owner": w.owner_node,
                  "lease_left_s": None if w.lease_expires_at is None
                  else round(w.lease_expires_at - now, 1),
                  "attempts": w.attempts, "deaths": w.deaths}
                 for w in open_rows[:MAX_OPEN]],
        "oldest_lease": oldest,
        "expired_leases": s.expired_leases,
        "dead": [{"work_key": w.work_key, "task": w.task_name, "deaths": w.deaths,
                  "error": w.error, "updated_at": iso(w.updated_at)} for w in s.dead],
        "beat": {"slots_pending": s.slots_pending,
                 "oldest_pending_claim": iso(s.oldest_pending_slot_claim)},
        "contexts": {"count": s.contexts, "oldest_write": iso(s.oldest_context)},
        "workers": [{"node": n, "incarnation": i, "heartbeat_at": iso(h),
                     "heartbeat_age_s": round(now - h, 1), "stopped_at": iso(st)}
                    for n, i, h, st in s.workers],
    }


def since(iso: str | None, now: float) -> str:
    if iso is None:
        return "-"
    return ago(datetime.fromisoformat(iso).timestamp(), now)


def render_status(data: dict[str, Any], echo: Callable[[str], Any],
                  error: Callable[[str], Any]) -> None:
    """The human form of :func:`status_report`, one line per ``echo`` call."""
    echo(f"store: {data['store']} (prefix {data['table_prefix']})")
    if "error" in data:
        error(f"Error: {data['error']}")
        return
    now = datetime.fromisoformat(data["now"]).timestamp()
    by_state: dict[str, int] = data["work"]
    lines: list[str] = []
    out = lines.append
    out("work by state:")
    rows(out, ("state", "count"),
          [(st, by_state.get(st, 0)) for st in ALL_STATES if by_state.get(st)]
          + [(st, n) for st, n in sorted(by_state.items()) if st not in ALL_STATES])
    out("open claims by owner:")
    rows(out, ("state", "owner", "count"),
          [(o["state"], o["owner"], o["count"]) for o in data["open_by_owner"]])
    oldest = data["oldest_lease"]
    if oldest is None:
        out("oldest lease: -")
    else:
        expired = "EXPIRED " if oldest["left_s"] < 0 else ""
        out(f"oldest lease: {oldest['work_key']} {expired}"
            f"(expires {since(oldest['expires_at'], now)})")
    if data["expired_leases"]:
        out(f"expired leases: {data['expired_leases']} (re-published by the next sweep, or "
            "now by `resilient recover`)")
    if data["open"]:
        out(f"open claims (up to {MAX_OPEN}, soonest expiry first):")
        rows(out, ("work key", "task", "state", "owner", "lease", "att", "deaths"),
              [(o["work_key"], o["task"], o["state"], o["owner"],
                None if o["lease_left_s"] is None else lease_text(now + o["lease_left_s"], now),
                o["attempts"], o["deaths"]) for o in data["open"]])
    out(f"dead work: {by_state.get(DEAD, 0)}")
    rows(out, ("work key", "task", "deaths", "since", "reason"),
          [(d["work_key"], d["task"], d["deaths"], since(d["updated_at"], now),
            (d["error"] or "")[:60]) for d in data["dead"]])
    beat = data["beat"]
    out(f"beat slots claimed, not sent: {beat['slots_pending']}"
        + ("" if beat["oldest_pending_claim"] is None
           else f" (oldest claimed {since(beat['oldest_pending_claim'], now)})"))
    ctxs = data["contexts"]
    out(f"contexts: {ctxs['count']}" + ("" if ctxs["oldest_write"] is None
                                        else f" (oldest written "
                                             f"{since(ctxs['oldest_write'], now)})"))
    out("workers (latest heartbeats):")
    rows(out, ("node", "incarnation", "heartbeat", "stopped"),
          [(x["node"], x["incarnation"][:12], since(x["heartbeat_at"], now),
            "-" if x["stopped_at"] is None else since(x["stopped_at"], now))
           for x in data["workers"]])
    for line in lines:
        echo(line)


def lease_text(at: float, now: float) -> str:
    return f"{at - now:.0f}s left" if at >= now else f"expired {now - at:.0f}s ago"
