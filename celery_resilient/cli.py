"""``celery -A proj resilient <command>``: operate the store from Celery's own CLI.

``migrate`` creates or upgrades the schema; ``status``, ``work``, ``schedule`` and every
``--dry-run`` only read; ``recover`` re-publishes orphans now; ``cancel``, ``retry`` and
``forget`` stop, re-run or delete chosen work; ``prune`` deletes old ended work (and, only
when asked, old ledger markers). Commands that change work chosen by a filter, and ``prune``,
ask for confirmation unless ``--yes``. Human tables by default, ``--json`` for scripts.
Store URLs are shown with their password masked. See ``docs/operations.md``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options
from sqlalchemy.exc import SQLAlchemyError

from celery_resilient.beat import windows
from celery_resilient.core.identity import Owner
from celery_resilient.core.states import ALL_STATES
from celery_resilient.errors import ResilientError
from celery_resilient.ops import operations, reports
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import migrate as migrations
from celery_resilient.store.admin_queries import (
    AdminQueries,
    EntrySlots,
    OrphanCandidate,
    PruneCounts,
)
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.operator_queries import (
    CANCEL_SOURCES,
    FORGET_SOURCES,
    RETRY_SOURCES,
    ActionReport,
    Selection,
    SelectionError,
    prune_workers,
    prune_workers_count,
)
from celery_resilient.store.sql import Store, WorkInfo
from celery_resilient.worker import recovery

STATES = ALL_STATES
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
_EXAMPLES = "30s, 15m, 12h, 7d, 2w, or combined like 1d12h"


def parse_duration(text: str) -> float:
    """``30s``, ``15m``, ``12h``, ``7d``, ``2w`` or combined (``1d12h``) -> seconds.

    Every number needs its unit: a bare ``7`` meant as days but read as seconds would make
    ``prune`` delete nearly everything, so it is refused rather than guessed.
    """
    value = text.strip().lower()
    if not value:
        raise ValueError(f"an empty duration; use e.g. {_EXAMPLES}")
    pos, total = 0, 0.0
    while pos < len(value):
        m = _DURATION_RE.match(value, pos)
        if m is None:
            raise ValueError(f"{text!r} is not a duration; use e.g. {_EXAMPLES}")
        number, unit = m.groups()
        if not unit:
            raise ValueError(f"{text!r} has no unit after {number}: write {number}s, "
                             f"{number}m, {number}h, {number}d or {number}w")
        if unit not in _UNITS:
            raise ValueError(f"{text!r} has an unknown unit {unit!r}: use s, m, h, d or w")
        total += float(number) * _UNITS[unit]
        pos = m.end()
    if total <= 0:
        raise ValueError(f"{text!r} is not a positive duration; use e.g. {_EXAMPLES}")
    return total


def _duration(value: str, option: str) -> float:
    """``value`` as seconds, or a usage error naming ``option`` and the problem."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{option}'") from None


# -- plumbing ---------------------------------------------------------------------------------

def _runtime(ctx: click.Context) -> Runtime:
    app = ctx.obj.app
    try:
        _configure_from_django(app)
        rt = Runtime.of(app)
        _ = rt.config  # resolved once, here: errors are usage errors of this command
    except ResilientError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    return rt


def _configure_from_django(app: Any) -> None:
    """Give a Celery app configured from Django's settings the store its worker uses.

    A worker sets Django up before it reads any setting (Celery's Django fixup calls
    ``django.setup()`` when it imports the task modules), and the Django app's ``ready()``
    then defaults the store to ``DATABASES["default"]`` (``configure_from_django``). A
    ``celery -A proj resilient`` command imports no task module, so without this it read the
    settings before Django was set up and fell back to the SQLite file in the working
    directory. Both now go through the same ``configure_from_django``.
    """
    if "django" not in sys.modules and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return
    try:  # optional dependency: only a Django project has it
        import django  # noqa: PLC0415
        from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415

        from celery_resilient.contrib.django.conf import (  # noqa: PLC0415
            configure_from_django,
            reads_django_settings,
        )
    except ImportError:
        return
    if not reads_django_settings(app):
        return
    try:
        django.setup()  # idempotent; runs the app config's ready()
    except ImproperlyConfigured as exc:
        raise click.ClickException(
            f"the Celery app reads Django's settings, but Django could not be set up: {exc}. "
            "Set DJANGO_SETTINGS_MODULE (as proj/celery.py usually does)") from None
    configure_from_django(app)




def _announce(rt: Runtime) -> None:
    """Name the store a command acts on (human output; JSON carries a ``store`` key)."""
    click.echo(f"store: {reports.describe_store(rt.config)}")


def _store(ctx: click.Context, as_json: bool = False) -> tuple[Runtime, Store]:
    """The app's store with its schema checked, created or upgraded only where a worker
    would do it itself (``resilient_auto_migrate``; SQLite stores by default)."""
    rt = _runtime(ctx)
    try:
        store = _checked(rt.config)
    except ResilientError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    except SQLAlchemyError as exc:
        raise click.ClickException(
            f"the store {reports.describe_store(rt.config)} is unreachable: {exc}") from None
    ctx.call_on_close(store.dispose)
    if not as_json:
        _announce(rt)
    return rt, store


def _checked(cfg: ResilientConfig) -> Store:
    """A store for ``cfg`` whose schema is current; migrated exactly when a worker would."""
    store = Store(cfg.store_url, cfg.table_prefix)
    try:
        store.ensure_schema(migrate_if_needed=cfg.migrates_itself)
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








def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ",
           err: bool = False) -> None:
    reports.rows(lambda line: click.echo(line, err=err), headers, rows, indent)




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
        "lease_expires_at": reports.iso(w.lease_expires_at),
        "lease_left_s": None if w.lease_expires_at is None
        else round(w.lease_expires_at - now, 1),
        "attempts": w.attempts, "deaths": w.deaths, "republished": w.republished,
        "has_message": w.has_message, "error": w.error,
        "created_at": reports.iso(w.created_at), "updated_at": reports.iso(w.updated_at),
        "finished_at": reports.iso(w.finished_at),
    }


option_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
option_yes = click.option("--yes", "-y", is_flag=True,
                          help="Do not ask for confirmation (needed when stdin is not a "
                               "terminal).")


@contextmanager
def _json_errors(as_json: bool) -> Iterator[None]:
    """With ``--json``, errors too are JSON on stdout (``{"error": ...}``), same exit code."""
    try:
        yield
    except click.ClickException as exc:
        if not as_json:
            raise
        _echo_json({"error": exc.format_message(), "exit_code": exc.exit_code})
        raise click.exceptions.Exit(exc.exit_code) from None


def _interactive() -> bool:
    """Whether someone can answer a prompt (tests replace this)."""
    return sys.stdin.isatty()


def _confirm(question: str, what: str) -> None:
    """Ask ``question`` on stderr; refuse (nothing changed) on no, or without a terminal."""
    if not _interactive():
        raise click.ClickException(
            f"{what} asks for confirmation, and stdin is not a terminal: nothing was changed. "
            "Pass --yes to confirm, or --dry-run to list what it would do")
    try:
        yes = click.confirm(question, default=False, err=True)
    except click.Abort:  # end of input, or Ctrl-C
        yes = False
    if not yes:
        raise click.ClickException("not confirmed: nothing was changed")


# -- commands ---------------------------------------------------------------------------------

@click.group(name="resilient", cls=click.Group)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def resilient(ctx: click.Context) -> None:
    """celery-resilient: migrate, inspect, recover, cancel, retry, forget and prune the
    durable store."""


@resilient.command(cls=CeleryCommand)
@option_json
@click.pass_context
def migrate(ctx: click.Context, as_json: bool) -> None:
    """Create or upgrade the store's schema to the current revision."""
    with _json_errors(as_json):
        rt = _runtime(ctx)
        data, code = reports.migrate_report(rt.config)
        if code and not as_json:
            raise click.ClickException(data["error"])
    _echo_json(data) if as_json else click.echo(reports.migrate_text(data))
    if code:
        ctx.exit(code)


@resilient.command(cls=CeleryCommand)
@option_json
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Work by state, open claims with their owners and leases, dead work, pending beat
    slots, contexts and workers. Exits 1 when the schema is missing or old, or the store
    cannot be read."""
    with _json_errors(as_json):
        rt = _runtime(ctx)
        data, code = reports.status_report(rt.config, migrations.FIX_COMMAND)
    if as_json:
        _echo_json(data)
    else:
        reports.render_status(data, click.echo, lambda line: click.echo(line, err=True))
    if code:
        ctx.exit(code)



















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
    with _json_errors(as_json):
        _, store = _store(ctx, as_json)
        rows = _run(lambda: AdminQueries(store).list_work(states, task, owner, limit))
        now = _run(store.now)
        if as_json:
            _echo_json([_work_dict(w, now) for w in rows])
            return
        _table(("work key", "task", "state", "owner", "lease", "att", "deaths", "updated"),
               [(w.work_key, w.task_name, w.state, w.owner_node,
                 None if w.lease_expires_at is None
                 else reports.lease_text(w.lease_expires_at, now),
                 w.attempts, w.deaths, reports.ago(w.updated_at, now)) for w in rows], indent="")




@work.command(name="show", cls=CeleryCommand)
@click.argument("work_key")
@option_json
@click.pass_context
def work_show(ctx: click.Context, work_key: str, as_json: bool) -> None:
    """One unit of work with its checkpoint, steps, ledger marks, error and result."""
    with _json_errors(as_json):
        _, store = _store(ctx, as_json)
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
                "seq": cp.seq, "epoch": cp.epoch, "updated_at": reports.iso(cp.updated_at),
                "state": _json_value(cp.state_json)},
            "steps": [{"name": s.name, "epoch": s.epoch, "at": reports.iso(s.created_at),
                       "result": _json_value(s.result_json)} for s in detail.steps],
            "ledger": [{"key": x.key, "epoch": x.epoch, "applied_at": reports.iso(x.applied_at)}
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
                ("lease", "-" if w.lease_expires_at is None
                 else reports.lease_text(w.lease_expires_at, now)),
                ("attempts", f"{w.attempts} (deaths {w.deaths}, re-published {w.republished})"),
                ("created", f"{reports.iso(w.created_at)} ({reports.ago(w.created_at, now)})"),
                ("updated", f"{reports.iso(w.updated_at)} ({reports.ago(w.updated_at, now)})"),
                ("finished", reports.iso(w.finished_at) or "-"),
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
            click.echo(f"checkpoint: #{cp.seq} at epoch {cp.epoch}, "
                       f"saved {reports.ago(cp.updated_at, now)}")
            click.echo(f"  {cp.state_json}")
        click.echo("steps:")
        _table(("name", "epoch", "at", "result"),
               [(s.name, s.epoch, reports.iso(s.created_at), s.result_json[:60])
                for s in detail.steps])
        click.echo("ledger:")
        _table(("key", "epoch", "applied"),
               [(x.key, x.epoch, reports.iso(x.applied_at)) for x in detail.ledger])


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
    with _json_errors(as_json):
        rt, store = _store(ctx, as_json)
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
        ctx.call_on_close(rt.store.dispose)  # the sweep below uses the app's store
        who = Owner(node or f"resilient-cli@{socket.gethostname()}", uuid.uuid4().hex,
                    os.getpid())
        sent = _run(lambda: recovery.sweep(rt, who))
        sent_keys = {o.work_key for o in sent}
        missed = [c for c in candidates if c.work_key not in sent_keys]
        more = len(sent) >= batch
        if as_json:
            _echo_json({"dry_run": False,
                        "republished": [{"work_key": o.work_key, "task": o.task_name,
                                         "task_id": o.task_id,
                                         "previous_state": o.previous_state,
                                         "previous_owner": o.previous_owner} for o in sent],
                        "not_republished": [_candidate_dict(c, now) for c in missed],
                        "more": more})
            return
        click.echo(f"re-published {len(sent)} orphan(s)")
        _table(("work key", "task", "task id", "was", "previous owner"),
               [(o.work_key, o.task_name, o.task_id, o.previous_state, o.previous_owner)
                for o in sent])
        if missed:
            click.echo(f"{len(missed)} listed before but not re-published here (no stored "
                       "message, publish failed, or taken by a worker's sweeper meanwhile; see "
                       "the log):")
            _show_candidates(missed, now)
        if more:
            click.echo(f"a full batch (resilient_sweep_batch={batch}) was sent: run again "
                       "for more")


def _show_candidates(candidates: Sequence[OrphanCandidate], now: float) -> None:
    _table(("work key", "task", "state", "owner", "why", "death", "message"),
           [(c.work_key, c.task_name, c.state, c.owner_node,
             "node gone" if c.reason == "node_gone"
             else f"lease expired {reports.span(now - (c.lease_expires_at or now))} ago",
             "yes" if c.state == "running" else "no",
             "stored" if c.has_message else "MISSING") for c in candidates])


@resilient.command(cls=CeleryCommand)
@click.option("--older-than", "older_than", default=None, metavar="DURATION",
              help="Age of what is deleted, with its unit: 30s, 15m, 12h, 7d, 2w. Required.")
@click.option("--ledger/--no-ledger", default=False, show_default=True,
              help="Also delete ledger markers applied before the cutoff. A deleted marker "
                   "no longer stops its effect from being applied again.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@option_yes
@option_json
@click.pass_context
def prune(ctx: click.Context, older_than: str | None, ledger: bool, dry_run: bool, yes: bool,
          as_json: bool) -> None:
    """Delete ended work (done, failed, ignored, revoked, expired, cancelled, dead) with its
    checkpoint and steps, and old revocation tombstones; with --ledger, old ledger markers
    too. A deleted key is no longer de-duplicated: keep more than any redelivery or catch-up
    window. Asks for confirmation unless --yes or --dry-run."""
    with _json_errors(as_json):
        if older_than is None:
            raise click.UsageError("--older-than is required (e.g. --older-than 30d)")
        seconds = _duration(older_than, "--older-than")
        rt, store = _store(ctx, as_json)
        queries = AdminQueries(store)
        lease = rt.config.lease_seconds
        counts: PruneCounts
        if dry_run:
            counts = _run(lambda: queries.prune_counts(seconds, ledger=ledger))
            workers = _run(lambda: prune_workers_count(store, seconds, lease))
        elif yes:
            counts = _run(lambda: queries.prune(seconds, ledger=ledger))
            workers = _run(lambda: prune_workers(store, seconds, lease))
        else:
            planned: PruneCounts = _run(lambda: queries.prune_counts(seconds, ledger=ledger))
            workers = _run(lambda: prune_workers_count(store, seconds, lease))
            if planned.total + workers == 0:
                counts = planned  # nothing to confirm: nothing is deleted
            else:
                _confirm(f"delete {_prune_summary(planned, workers)}, older than "
                         f"{reports.span(seconds)}?", "prune")
                counts = _run(lambda: queries.prune(seconds, ledger=ledger))
                workers = _run(lambda: prune_workers(store, seconds, lease))
    if as_json:
        _echo_json({"store": sanitize_url(rt.config.store_url), "dry_run": dry_run,
                    "older_than_s": seconds, "ledger": ledger,
                    ("would_delete" if dry_run else "deleted"): {**counts.as_dict(),
                                                                  "workers": workers}})
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"older than {reports.span(seconds)}: {verb} {_prune_summary(counts, workers)}"
               + ("" if ledger else " (ledger markers kept: --ledger deletes them)"))


def _prune_summary(counts: PruneCounts, workers: int) -> str:
    return (f"{counts.work} ended work ({counts.checkpoints} checkpoints, {counts.steps} "
            f"steps), {counts.ledger} ledger markers, {counts.revocations} revocation "
            f"tombstones and {workers} stopped worker starts")


# -- cancel, retry, forget --------------------------------------------------------------------

def _selection_options(sources: Sequence[str]) -> Callable[[Callable[..., Any]],
                                                           Callable[..., Any]]:
    """Work keys as arguments and/or a filter, plus --dry-run, --yes and --json."""
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed((
            click.argument("work_keys", nargs=-1, metavar="[WORK_KEY]..."),
            click.option("--state", "states", multiple=True, metavar="STATE",
                         help=f"Only work in this state (repeatable): {', '.join(sources)}. "
                              "Default: all of those."),
            click.option("--task", default=None, help="Only work of this task name."),
            click.option("--older-than", "older_than", default=None, metavar="DURATION",
                         help="Only work that finished (open work: last changed) longer "
                              "ago than this: 30s, 15m, 12h, 7d, 2w."),
            click.option("--dry-run", is_flag=True,
                         help="List what would change and what would be refused; change "
                              "nothing."),
            option_yes,
            option_json,
        )):
            fn = option(fn)
        return fn
    return decorate


def _operate(ctx: click.Context, action: str, work_keys: tuple[str, ...],
             states: tuple[str, ...], task: str | None, older_than: str | None, dry_run: bool,
             yes: bool, as_json: bool,
             act: Callable[[Runtime, Selection, bool], ActionReport]) -> None:
    """Shared body of cancel, retry and forget: validate, confirm a filter, act, report.

    Named keys act at once (the operator named each one). A filter alone is first run as a
    dry run and shown; after confirmation only the listed work is acted on (each row is
    checked again under its lock), never work that matched meanwhile.
    """
    with _json_errors(as_json):
        selection = Selection(tuple(work_keys), tuple(states), task,
                              None if older_than is None
                              else _duration(older_than, "--older-than"))
        try:
            selection = selection.checked(action)
        except SelectionError as exc:
            raise click.UsageError(str(exc)) from None
        rt, _ = _store(ctx, as_json)  # the schema is checked (migrated only as a worker would)
        ctx.call_on_close(rt.store.dispose)
        if dry_run:
            report = _run(lambda: act(rt, selection, True))
        elif selection.keys or yes:
            report = _run(lambda: act(rt, selection, False))
        else:
            preview = _run(lambda: act(rt, selection, True))
            if not preview.changed:
                report = replace(preview, dry_run=False)  # nothing to confirm or change
            else:
                _show_report(preview, as_json=False, err=True)
                _confirm(f"{action} {len(preview.changed)} unit(s) of work "
                         f"({selection.describe()})?", f"{action} with a filter")
                listed = tuple(t.work_key for t in preview.changed)
                report = _run(lambda: act(rt, Selection(
                    listed, selection.states, selection.task, selection.older_than), False))
                report = replace(report, refused=preview.refused + report.refused)
    _show_report(report, as_json)
    if not report.ok:
        ctx.exit(1)


_PAST = {"cancel": "cancelled", "retry": "retried", "forget": "forgot"}


def _show_report(report: ActionReport, as_json: bool, err: bool = False) -> None:
    if as_json:
        data: dict[str, Any] = {
            "action": report.action, "dry_run": report.dry_run,
            ("would_change" if report.dry_run else "changed"): [
                {"work_key": t.work_key, "task": t.task_name, "task_id": t.task_id,
                 "previous_state": t.previous_state, "owner": t.owner_node}
                for t in report.changed],
            "refused": [{"work_key": r.work_key, "state": r.state, "reason": r.reason}
                        for r in report.refused],
        }
        if report.action == "forget":
            data["checkpoints"], data["steps"] = report.checkpoints, report.steps
        if report.action == "retry":
            data["not_sent"] = [{"work_key": k, "error": e} for k, e in report.unsent]
        _echo_json(data)
        return
    verb = f"would {report.action}" if report.dry_run else _PAST[report.action]
    extra = ""
    if report.action == "forget":
        extra = (f" with {report.checkpoints} checkpoints and {report.steps} steps "
                 "(ledger markers kept)")
    click.echo(f"{verb} {len(report.changed)} unit(s) of work{extra}", err=err)
    if report.changed:
        _table(("work key", "task", "task id", "was", "owner"),
               [(t.work_key, t.task_name, t.task_id, t.previous_state, t.owner_node)
                for t in report.changed], err=err)
    if report.refused:
        word = "would refuse" if report.dry_run else "refused"
        click.echo(f"{word} {len(report.refused)}:", err=err)
        _table(("work key", "state", "reason"),
               [(r.work_key, r.state or "-", r.reason) for r in report.refused], err=err)
    if report.unsent:
        click.echo(f"{len(report.unsent)} re-queued but not sent (a worker's sweep sends them "
                   "after resilient_submit_timeout):", err=err)
        _table(("work key", "error"), report.unsent, err=err)


@resilient.command(cls=CeleryCommand)
@_selection_options(CANCEL_SOURCES)
@click.option("--reason", default=None,
              help="Why; recorded as the work's error: 'cancelled by operator: REASON'.")
@click.pass_context
def cancel(ctx: click.Context, work_keys: tuple[str, ...], states: tuple[str, ...],
           task: str | None, older_than: str | None, dry_run: bool, yes: bool, as_json: bool,
           reason: str | None) -> None:
    """Cancel open work (reserved, running, requeued): it never runs again under its task
    id. Running work is not interrupted: its next checkpoint, step, ledger write or result
    is refused, and its caller sees REVOKED. A filter without named keys asks for
    confirmation unless --yes; exits 1 when anything was refused."""
    _operate(ctx, "cancel", work_keys, states, task, older_than, dry_run, yes, as_json,
             lambda rt, sel, dry: operations.cancel(rt, sel, reason, dry_run=dry))


@resilient.command(cls=CeleryCommand)
@_selection_options(RETRY_SOURCES)
@click.pass_context
def retry(ctx: click.Context, work_keys: tuple[str, ...], states: tuple[str, ...],
          task: str | None, older_than: str | None, dry_run: bool, yes: bool,
          as_json: bool) -> None:
    """Run ended work again with its task id (failed, ignored, revoked, expired, cancelled,
    dead; never done): deaths and re-publishes reset, its revocation tombstone deleted, its
    stored message sent again (without its expires). A filter without named keys asks for
    confirmation unless --yes; exits 1 when anything was refused or not sent."""
    _operate(ctx, "retry", work_keys, states, task, older_than, dry_run, yes, as_json,
             lambda rt, sel, dry: operations.retry(rt, sel, dry_run=dry))


@resilient.command(cls=CeleryCommand)
@_selection_options(FORGET_SOURCES)
@click.pass_context
def forget(ctx: click.Context, work_keys: tuple[str, ...], states: tuple[str, ...],
           task: str | None, older_than: str | None, dry_run: bool, yes: bool,
           as_json: bool) -> None:
    """Delete ended work with its checkpoint and steps (never open work). Its ledger
    markers are kept, so effects it applied are still not applied again; a later delivery
    of the same key runs as new work. A filter without named keys asks for confirmation
    unless --yes; exits 1 when anything was refused."""
    _operate(ctx, "forget", work_keys, states, task, older_than, dry_run, yes, as_json,
             lambda rt, sel, dry: operations.forget(rt, sel, dry_run=dry))


@resilient.command(cls=CeleryCommand)
@click.option("--prefix", default=None,
              help="Entry key prefix (default: the app's redbeat_key_prefix).")
@option_json
@click.pass_context
def schedule(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Beat entries: last slot sent, next slot, missed slots, slots claimed but not sent."""
    with _json_errors(as_json):
        rt, store = _store(ctx, as_json)
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
    outer = _json_value(text)
    inner = outer.get("definition") if isinstance(outer, dict) else None
    if not isinstance(inner, str):
        return {}
    parsed = _json_value(inner)
    result: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    result["_raw"] = inner
    return result


__all__ = ["parse_duration", "resilient"]
