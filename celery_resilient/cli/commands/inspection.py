"""The commands that only read: ``status``, ``work``, ``work show`` and ``schedule``."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from celery_resilient.cli import context
from celery_resilient.cli.options import STATES, option_json
from celery_resilient.cli.output import echo_json, json_errors, table
from celery_resilient.ops import inspection, reports
from celery_resilient.ops import schedule as beat_entries
from celery_resilient.store import migrate as migrations


@click.command(cls=CeleryCommand)
@option_json
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Work by state, open claims with their owners and leases, dead work, pending beat
    slots, contexts and workers. Exits 1 when the schema is missing or old, or the store
    cannot be read."""
    with json_errors(as_json):
        rt = context.runtime(ctx)
        data, code = reports.status_report(rt.config, migrations.FIX_COMMAND)
    if as_json:
        echo_json(data)
    else:
        reports.render_status(data, click.echo, lambda line: click.echo(line, err=True))
    if code:
        ctx.exit(code)


@click.group(name="work", invoke_without_command=True)
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
    with json_errors(as_json):
        _, store = context.store(ctx, as_json)
        listed = context.run(lambda: inspection.list_work(store, states, task, owner, limit))
        now = listed.now
        if as_json:
            echo_json([inspection.work_json(w, now) for w in listed.rows])
            return
        table(("work key", "task", "state", "owner", "lease", "att", "deaths", "updated"),
              [(w.work_key, w.task_name, w.state, w.owner_node,
                None if w.lease_expires_at is None
                else reports.lease_text(w.lease_expires_at, now),
                w.attempts, w.deaths, reports.ago(w.updated_at, now)) for w in listed.rows],
              indent="")


@work.command(name="show", cls=CeleryCommand)
@click.argument("work_key")
@option_json
@click.pass_context
def work_show(ctx: click.Context, work_key: str, as_json: bool) -> None:
    """One unit of work with its checkpoint, steps, ledger marks, error and result."""
    with json_errors(as_json):
        _, store = context.store(ctx, as_json)
        view = context.run(lambda: inspection.show_work(store, work_key))
        if view is None:
            raise click.ClickException(f"no work is stored under {work_key!r}")
        if as_json:
            echo_json(inspection.work_view_json(view))
            return
        _print_work(view)


def _print_work(view: inspection.WorkView) -> None:
    detail, now = view.detail, view.now
    w, cp = detail.work, detail.checkpoint
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
    table(("name", "epoch", "at", "result"),
          [(s.name, s.epoch, reports.iso(s.created_at), s.result_json[:60])
           for s in detail.steps])
    click.echo("ledger:")
    table(("key", "epoch", "applied"),
          [(x.key, x.epoch, reports.iso(x.applied_at)) for x in detail.ledger])


@click.command(cls=CeleryCommand)
@click.option("--prefix", default=None,
              help="Entry key prefix (default: the app's redbeat_key_prefix).")
@option_json
@click.pass_context
def schedule(ctx: click.Context, prefix: str | None, as_json: bool) -> None:
    """Beat entries: last slot sent, next slot, missed slots, slots claimed but not sent."""
    with json_errors(as_json):
        rt, store = context.store(ctx, as_json)
        app = rt.app
        entry_prefix = beat_entries.default_prefix(app) if prefix is None else prefix
        rows = context.run(lambda: beat_entries.entries(app, store, entry_prefix))
        if as_json:
            echo_json(rows)
            return
        table(("entry", "task", "last slot", "next slot", "missed", "pending", "sent", "skipped"),
              [(r["name"], r["task"], r["last_slot"],
                r["next_slot"] if r["next_slot"] is not None else "?",
                "?" if r["missed"] is None else r["missed"], r["pending"], r["sent"],
                r["skipped"]) for r in rows], indent="")
        notes = {r["note"] for r in rows if r["note"]}
        for note in sorted(notes):
            click.echo(f"note: {note}")


__all__ = ["schedule", "status", "work", "work_show"]
