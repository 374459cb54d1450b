"""``celery -A proj resilient <command>``: operate the store from Celery's own CLI.

``migrate`` creates or upgrades the schema; ``status``, ``work``, ``schedule`` and every
``--dry-run`` only read; ``recover`` re-publishes orphans now; ``prune`` deletes finished work
and old ledger markers. Human tables by default, ``--json`` for scripts. Store URLs are shown
with their password masked. See ``docs/operations.md``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from .app import Resilient
from .config import sanitize_url
from .errors import ResilientError
from .states import ALL_STATES, DEAD
from .store import migrate as migrations
from .store.admin_queries import (
    AdminQueries,
    EntrySlots,
    OrphanCandidate,
    PruneCounts,
    WorkInfo,
)
from .store.sql import Owner, Store

STATES = ALL_STATES
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` or combined (``1d12h``) -> seconds."""
    value = text.strip().lower()
    pos, total = 0, 0.0
    while pos < len(value):
        m = _DURATION_RE.match(value, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"{text!r} is not a duration (use e.g. 90s, 15m, 12h, 7d, 2w)")
        total += float(m.group(1)) * _UNITS[m.group(2) or "s"]
        pos = m.end()
    if not value or total <= 0:
        raise ValueError(f"{text!r} is not a positive duration (use e.g. 90s, 15m, 12h, 7d)")
    return total


def _duration_option(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


# -- plumbing ---------------------------------------------------------------------------------

def _runtime(ctx: click.Context) -> Resilient:
    app = ctx.obj.app
    try:
        return Resilient.of(app)
    except ResilientError as exc:
        raise click.ClickException(str(exc)) from None


def _store(ctx: click.Context) -> tuple[Resilient, Store]:
    """The app's store with its schema checked (never created: use ``migrate`` for that)."""
    rt = _runtime(ctx)
    try:
        store = _checked(rt)
    except ResilientError as exc:
        raise click.ClickException(str(exc)) from None
    ctx.call_on_close(store.dispose)
    return rt, store


def _checked(rt: Resilient) -> Store:
    cfg = rt.config
    store = Store(cfg.store_url, cfg.table_prefix)
    try:
        store.ensure_schema(migrate_if_needed=False)
    except BaseException:
        store.dispose()
        raise
    return store


def _run(fn: Callable[[], Any]) -> Any:
    """Turn the library's errors (store down, bad schema) into a clean CLI error."""
    try:
        return fn()
    except ResilientError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    delta = now - ts
    word = "ago" if delta >= 0 else "from now"
    return f"{_span(abs(delta))} {word}"


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86_400:.1f}d"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> None:
    if not rows:
        click.echo(f"{indent}(none)")
        return
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    click.echo(indent + "  ".join(h.upper().ljust(w) for h, w in zip(headers, widths,
                                                                     strict=True)).rstrip())
    for r in cells:
        click.echo(indent + "  ".join(v.ljust(w) for v, w in zip(r, widths,
                                                                 strict=True)).rstrip())


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def _json_value(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _work_dict(w: WorkInfo, now: float) -> dict[str, Any]:
    return {
        "work_key": w.work_key, "task": w.task_name, "task_id": w.task_id, "state": w.state,
        "epoch": w.epoch, "owner": w.owner_node, "incarnation": w.incarnation,
        "pid": w.owner_pid,
        "lease_expires_at": _iso(w.lease_expires_at),
        "lease_left_s": None if w.lease_expires_at is None
        else round(w.lease_expires_at - now, 1),
        "attempts": w.attempts, "deaths": w.deaths, "republished": w.republished,
        "has_message": w.has_message, "error": w.error,
        "created_at": _iso(w.created_at), "updated_at": _iso(w.updated_at),
        "finished_at": _iso(w.finished_at),
    }


option_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


# -- commands ---------------------------------------------------------------------------------

@click.group(name="resilient", cls=click.Group)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def resilient(ctx: click.Context) -> None:
    """celery-resilient: migrate, inspect, recover and prune the durable store."""


@resilient.command(cls=CeleryCommand)
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the store's schema to the current revision."""
    rt = _runtime(ctx)
    cfg = _run(lambda: rt.config)
    store = Store(cfg.store_url, cfg.table_prefix)
    ctx.call_on_close(store.dispose)
    _run(store.migrate)
    info = migrations.describe(store.engine, cfg.table_prefix)
    click.echo(f"schema of {sanitize_url(cfg.store_url)} (prefix {cfg.table_prefix}) "
               f"is at revision {info['current']}")


@resilient.command(cls=CeleryCommand)
@option_json
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Claims by state and owner, oldest lease, dead work, pending beat slots, contexts."""
    rt, store = _store(ctx)
    s = _run(AdminQueries(store).status)
    now = s.now
    oldest = None if s.oldest_lease is None else {
        "work_key": s.oldest_lease[0], "expires_at": _iso(s.oldest_lease[1]),
        "left_s": round(s.oldest_lease[1] - now, 1)}
    data: dict[str, Any] = {
        "store": sanitize_url(rt.config.store_url),
        "table_prefix": rt.config.table_prefix,
        "now": _iso(now),
        "work": s.by_state,
        "open_by_owner": [{"state": st, "owner": o, "count": n} for st, o, n in s.by_owner],
        "oldest_lease": oldest,
        "expired_leases": s.expired_leases,
        "dead": [{"work_key": w.work_key, "task": w.task_name, "deaths": w.deaths,
                  "error": w.error, "updated_at": _iso(w.updated_at)} for w in s.dead],
        "beat": {"slots_pending": s.slots_pending,
                 "oldest_pending_claim": _iso(s.oldest_pending_slot_claim)},
        "contexts": {"count": s.contexts, "oldest_write": _iso(s.oldest_context)},
        "workers": [{"node": n, "incarnation": i, "heartbeat_at": _iso(h),
                     "heartbeat_age_s": round(now - h, 1), "stopped_at": _iso(st)}
                    for n, i, h, st in s.workers],
    }
    if as_json:
        _echo_json(data)
        return
    click.echo(f"store: {data['store']} (prefix {data['table_prefix']})")
    click.echo("work by state:")
    _table(("state", "count"), [(st, s.by_state.get(st, 0)) for st in STATES
                                if s.by_state.get(st)] +
           [(st, n) for st, n in sorted(s.by_state.items()) if st not in STATES])
    click.echo("open claims by owner:")
    _table(("state", "owner", "count"), s.by_owner)
    if s.oldest_lease is None:
        click.echo("oldest lease: -")
    else:
        key, at = s.oldest_lease
        state = "EXPIRED " if at < now else ""
        click.echo(f"oldest lease: {key} {state}(expires {_ago(at, now)})")
    if s.expired_leases:
        click.echo(f"expired leases: {s.expired_leases} (re-published by the next sweep, or "
                   "now by `resilient recover`)")
    click.echo(f"dead work: {s.by_state.get(DEAD, 0)}")
    _table(("work key", "task", "deaths", "since", "reason"),
           [(w.work_key, w.task_name, w.deaths, _ago(w.updated_at, now),
             (w.error or "")[:60]) for w in s.dead])
    click.echo(f"beat slots claimed, not sent: {s.slots_pending}"
               + ("" if s.oldest_pending_slot_claim is None
                  else f" (oldest claimed {_ago(s.oldest_pending_slot_claim, now)})"))
    click.echo(f"contexts: {s.contexts}"
               + ("" if s.oldest_context is None
                  else f" (oldest written {_ago(s.oldest_context, now)})"))
    click.echo("workers (latest heartbeats):")
    _table(("node", "incarnation", "heartbeat", "stopped"),
           [(n, i[:12], _ago(h, now), "-" if st is None else _ago(st, now))
            for n, i, h, st in s.workers])


@resilient.group(name="work", invoke_without_command=True)
@click.option("--state", "states", multiple=True, type=click.Choice(STATES),
              help="Only work in this state (repeatable).")
@click.option("--task", default=None, help="Only work of this task name.")
@click.option("--owner", default=None, help="Only work claimed by this worker node.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
@option_json
@click.pass_context
def work(ctx: click.Context, states: tuple[str, ...], task: str | None, owner: str | None,
         limit: int, as_json: bool) -> None:
    """List work (most recently changed first); `work show KEY` for one unit."""
    if ctx.invoked_subcommand is not None:
        return
    _, store = _store(ctx)
    rows = _run(lambda: AdminQueries(store).list_work(states, task, owner, limit))
    now = _run(store.now)
    if as_json:
        _echo_json([_work_dict(w, now) for w in rows])
        return
    _table(("work key", "task", "state", "owner", "lease", "att", "deaths", "updated"),
           [(w.work_key, w.task_name, w.state, w.owner_node,
             None if w.lease_expires_at is None else _lease(w.lease_expires_at, now),
             w.attempts, w.deaths, _ago(w.updated_at, now)) for w in rows], indent="")


def _lease(at: float, now: float) -> str:
    return f"{at - now:.0f}s left" if at >= now else f"expired {now - at:.0f}s ago"


@work.command(name="show", cls=CeleryCommand)
@click.argument("work_key")
@option_json
@click.pass_context
def work_show(ctx: click.Context, work_key: str, as_json: bool) -> None:
    """One unit of work with its checkpoint, steps, ledger marks, error and result."""
    _, store = _store(ctx)
    detail = _run(lambda: AdminQueries(store).work_detail(work_key))
    if detail is None:
        raise click.ClickException(f"no work is stored under {work_key!r}")
    now = _run(store.now)
    w = detail.work
    cp = detail.checkpoint
    data = _work_dict(w, now)
    data.update({
        "result": _json_value(w.result_json),
        "checkpoint": None if cp is None else {
            "seq": cp.seq, "epoch": cp.epoch, "updated_at": _iso(cp.updated_at),
            "state": _json_value(cp.state_json)},
        "steps": [{"name": s.name, "epoch": s.epoch, "at": _iso(s.created_at),
                   "result": _json_value(s.result_json)} for s in detail.steps],
        "ledger": [{"key": x.key, "epoch": x.epoch, "applied_at": _iso(x.applied_at)}
                   for x in detail.ledger],
        "message": None if detail.message_route is None else {
            "exchange": detail.message_route[0], "routing_key": detail.message_route[1]},
    })
    if as_json:
        _echo_json(data)
        return
    for label, value in (
            ("work key", w.work_key), ("task", f"{w.task_name} (task id {w.task_id})"),
            ("state", w.state), ("epoch", w.epoch),
            ("owner", "-" if w.owner_node is None
             else f"{w.owner_node} incarnation {w.incarnation} pid {w.owner_pid}"),
            ("lease", "-" if w.lease_expires_at is None else _lease(w.lease_expires_at, now)),
            ("attempts", f"{w.attempts} (deaths {w.deaths}, re-published {w.republished})"),
            ("created", f"{_iso(w.created_at)} ({_ago(w.created_at, now)})"),
            ("updated", f"{_iso(w.updated_at)} ({_ago(w.updated_at, now)})"),
            ("finished", _iso(w.finished_at) or "-"),
            ("message", "not stored (cannot be re-published)" if detail.message_route is None
             else f"stored (exchange {detail.message_route[0]!r}, "
                  f"routing key {detail.message_route[1]!r})")):
        click.echo(f"{label + ':':<10} {value}")
    if w.error:
        click.echo(f"error:     {w.error}")
    if w.result_json is not None:
        click.echo(f"result:    {w.result_json}")
    if cp is None:
        click.echo("checkpoint: none")
    else:
        click.echo(f"checkpoint: #{cp.seq} at epoch {cp.epoch}, saved {_ago(cp.updated_at, now)}")
        click.echo(f"  {cp.state_json}")
    click.echo("steps:")
    _table(("name", "epoch", "at", "result"),
           [(s.name, s.epoch, _iso(s.created_at), s.result_json[:60]) for s in detail.steps])
    click.echo("ledger:")
    _table(("key", "epoch", "applied"),
           [(x.key, x.epoch, _iso(x.applied_at)) for x in detail.ledger])


def _candidate_dict(c: OrphanCandidate, now: float) -> dict[str, Any]:
    return {"work_key": c.work_key, "task": c.task_name, "task_id": c.task_id,
            "state": c.state, "owner": c.owner_node, "reason": c.reason,
            "lease_expired_s": None if c.lease_expires_at is None
            else round(now - c.lease_expires_at, 1),
            "counts_death": c.state == "running", "has_message": c.has_message}


@resilient.command(cls=CeleryCommand)
@click.option("--dry-run", is_flag=True, help="List what would be re-published; change nothing.")
@click.option("--node", default=None,
              help="Also take back every open claim of this worker node at once. Only for a "
                   "node that is down for good: a live node's running work would be fenced.")
@option_json
@click.pass_context
def recover(ctx: click.Context, dry_run: bool, node: str | None, as_json: bool) -> None:
    """Re-publish orphaned work now (open claims whose lease expired), with its task id."""
    rt, store = _store(ctx)
    batch = rt.config.sweep_batch
    queries = AdminQueries(store)
    candidates = _run(lambda: queries.orphan_candidates(batch, node))
    now = _run(store.now)
    if dry_run:
        if as_json:
            _echo_json({"dry_run": True, "would_republish": [
                _candidate_dict(c, now) for c in candidates]})
            return
        click.echo(f"{len(candidates)} orphan(s) would be re-published"
                   + (" (first batch)" if len(candidates) >= batch else ""))
        _show_candidates(candidates, now)
        return
    from . import recovery

    ctx.call_on_close(rt.store.dispose)  # the sweep below uses the app's store
    who = Owner(node or f"resilient-cli@{socket.gethostname()}", uuid.uuid4().hex, os.getpid())
    sent = _run(lambda: recovery.sweep(rt, who))
    sent_keys = {o.work_key for o in sent}
    missed = [c for c in candidates if c.work_key not in sent_keys]
    more = len(sent) >= batch
    if as_json:
        _echo_json({"dry_run": False,
                    "republished": [{"work_key": o.work_key, "task": o.task_name,
                                     "task_id": o.task_id, "previous_state": o.previous_state,
                                     "previous_owner": o.previous_owner} for o in sent],
                    "not_republished": [_candidate_dict(c, now) for c in missed],
                    "more": more})
        return
    click.echo(f"re-published {len(sent)} orphan(s)")
    _table(("work key", "task", "task id", "was", "previous owner"),
           [(o.work_key, o.task_name, o.task_id, o.previous_state, o.previous_owner)
            for o in sent])
    if missed:
        click.echo(f"{len(missed)} listed before but not re-published here (no stored message, "
                   "publish failed, or taken by a worker's sweeper meanwhile; see the log):")
        _show_candidates(missed, now)
    if more:
        click.echo(f"a full batch (resilient_sweep_batch={batch}) was sent: run again for more")


def _show_candidates(candidates: Sequence[OrphanCandidate], now: float) -> None:
    _table(("work key", "task", "state", "owner", "why", "death", "message"),
           [(c.work_key, c.task_name, c.state, c.owner_node,
             "node gone" if c.reason == "node_gone"
             else f"lease expired {_span(now - (c.lease_expires_at or now))} ago",
             "yes" if c.state == "running" else "no",
             "stored" if c.has_message else "MISSING") for c in candidates])


@resilient.command(cls=CeleryCommand)
@click.option("--older-than", "older_than", required=True, callback=_duration_option,
              help="Age of what is deleted: 90s, 15m, 12h, 7d, 2w.")
@click.option("--ledger/--no-ledger", default=True, show_default=True,
              help="Also delete ledger markers applied before the cutoff.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@option_json
@click.pass_context
def prune(ctx: click.Context, older_than: float, ledger: bool, dry_run: bool,
          as_json: bool) -> None:
    """Delete finished work (done, failed, dead) with its checkpoint and steps, and old
    ledger markers. A deleted key is no longer de-duplicated: keep more than any redelivery
    or catch-up window."""
    _, store = _store(ctx)
    queries = AdminQueries(store)
    if dry_run:
        counts: PruneCounts = _run(lambda: queries.prune_counts(older_than))
        if not ledger:
            counts = PruneCounts(counts.work, counts.checkpoints, counts.steps, 0)
    else:
        counts = _run(lambda: queries.prune(older_than, ledger=ledger))
    if as_json:
        _echo_json({"dry_run": dry_run, "older_than_s": older_than,
                    ("would_delete" if dry_run else "deleted"): counts.as_dict()})
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"older than {_span(older_than)}: {verb} {counts.work} finished work "
               f"({counts.checkpoints} checkpoints, {counts.steps} steps) and "
               f"{counts.ledger} ledger markers")


@resilient.command(cls=CeleryCommand)
@click.option("--prefix", default=None,
              help="Entry key prefix (default: the app's redbeat_key_prefix).")
@option_json
@click.pass_context
def schedule(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Beat entries: last slot sent, next slot, missed slots, slots claimed but not sent."""
    rt, store = _store(ctx)
    app = rt.app
    if prefix is None:
        redbeat_conf = getattr(app, "redbeat_conf", None)
        prefix = str(getattr(redbeat_conf, "key_prefix", "") or "")
    entries = _run(lambda: AdminQueries(store).schedule(prefix))
    now = _run(store.now)
    rows = [_entry_dict(app, e, now) for e in entries]
    if as_json:
        _echo_json(rows)
        return
    _table(("entry", "task", "last slot", "next slot", "missed", "pending", "sent", "skipped"),
           [(r["name"], r["task"], r["last_slot"],
             r["next_slot"] if r["next_slot"] is not None else "?",
             "?" if r["missed"] is None else r["missed"], r["pending"], r["sent"], r["skipped"])
            for r in rows], indent="")
    notes = {r["note"] for r in rows if r["note"]}
    for note in sorted(notes):
        click.echo(f"note: {note}")


def _entry_dict(app: Any, e: EntrySlots, now: float) -> dict[str, Any]:
    definition = _definition(e.definition_json)
    name = definition.get("name") if isinstance(definition.get("name"), str) else e.entry
    out: dict[str, Any] = {
        "entry": e.entry, "name": name, "task": definition.get("task"),
        "last_slot": _iso(e.last_slot), "next_slot": None, "missed": None,
        "pending": e.pending, "oldest_pending_claim": _iso(e.oldest_pending_claim),
        "sent": e.sent, "skipped": e.skipped, "last_sent_slot": _iso(e.last_sent_slot),
        "note": None,
    }
    try:
        from redbeat.schedulers import RedBeatSchedulerEntry

        from .beat import windows
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
    out["next_slot"] = None if nxt is None else _iso(windows.to_seconds(nxt))
    return out


def _definition(text: str | None) -> dict[str, Any]:
    """The RedBeat definition inside a marker (``{"static":..., "definition": "<json>"}``)."""
    outer = _json_value(text)
    inner = outer.get("definition") if isinstance(outer, dict) else None
    if not isinstance(inner, str):
        return {}
    parsed = _json_value(inner)
    result: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    result["_raw"] = inner
    return result


__all__ = ["parse_duration", "resilient"]
