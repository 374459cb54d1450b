"""The operator's actions on chosen work: ``cancel``, ``retry`` and ``forget``.

Each acts through :mod:`celery_resilient.ops.operations` (as the Django admin does), which
checks every row again under its lock and reports what it changed and what it refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_resilient.cli import context
from celery_resilient.cli.options import duration, selection_options
from celery_resilient.cli.output import echo_json, json_errors, table
from celery_resilient.cli.prompt import confirm
from celery_resilient.ops import operations
from celery_resilient.ops.operations import ActionReport, Selection, SelectionError
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.operator_queries import CANCEL_SOURCES, FORGET_SOURCES, RETRY_SOURCES

Act = Callable[[Runtime, Selection, bool], ActionReport]


def _operate(ctx: click.Context, action: str, work_keys: tuple[str, ...],
             states: tuple[str, ...], task: str | None, older_than: str | None, dry_run: bool,
             yes: bool, as_json: bool, act: Act) -> None:
    """Shared body of cancel, retry and forget: validate, confirm a filter, act, report.

    Named keys act at once (the operator named each one). A filter alone is first run as a
    dry run and shown; after confirmation only the listed work is acted on (each row is
    checked again under its lock), never work that matched meanwhile.
    """
    with json_errors(as_json):
        selection = Selection(tuple(work_keys), tuple(states), task,
                              None if older_than is None
                              else duration(older_than, "--older-than"))
        try:
            selection = selection.checked(action)
        except SelectionError as exc:
            raise click.UsageError(str(exc)) from None
        rt, _ = context.store(ctx, as_json)  # the schema is checked (migrated as a worker would)
        ctx.call_on_close(rt.store.dispose)
        if dry_run:
            report = context.run(lambda: act(rt, selection, True))
        elif selection.keys or yes:
            report = context.run(lambda: act(rt, selection, False))
        else:
            report = _confirmed(rt, action, selection, act)
    _show_report(report, as_json)
    if not report.ok:
        ctx.exit(1)


def _confirmed(rt: Runtime, action: str, selection: Selection, act: Act) -> ActionReport:
    """A filter's dry run shown on stderr, then, once confirmed, the listed work acted on."""
    preview = context.run(lambda: act(rt, selection, True))
    if not preview.changed:
        return replace(preview, dry_run=False)  # nothing to confirm or change
    _show_report(preview, as_json=False, err=True)
    confirm(f"{action} {len(preview.changed)} unit(s) of work ({selection.describe()})?",
            f"{action} with a filter")
    listed = tuple(t.work_key for t in preview.changed)
    report = context.run(lambda: act(rt, Selection(
        listed, selection.states, selection.task, selection.older_than), False))
    return replace(report, refused=preview.refused + report.refused)


_PAST = {"cancel": "cancelled", "retry": "retried", "forget": "forgot"}


def _show_report(report: ActionReport, as_json: bool, err: bool = False) -> None:
    if as_json:
        echo_json(_report_json(report))
        return
    verb = f"would {report.action}" if report.dry_run else _PAST[report.action]
    extra = ""
    if report.action == "forget":
        extra = (f" with {report.checkpoints} checkpoints and {report.steps} steps "
                 "(ledger markers kept)")
    click.echo(f"{verb} {len(report.changed)} unit(s) of work{extra}", err=err)
    if report.changed:
        table(("work key", "task", "task id", "was", "owner"),
              [(t.work_key, t.task_name, t.task_id, t.previous_state, t.owner_node)
               for t in report.changed], err=err)
    if report.refused:
        word = "would refuse" if report.dry_run else "refused"
        click.echo(f"{word} {len(report.refused)}:", err=err)
        table(("work key", "state", "reason"),
              [(r.work_key, r.state or "-", r.reason) for r in report.refused], err=err)
    if report.unsent:
        click.echo(f"{len(report.unsent)} re-queued but not sent (a worker's sweep sends them "
                   "after resilient_submit_timeout):", err=err)
        table(("work key", "error"), report.unsent, err=err)


def _report_json(report: ActionReport) -> dict[str, Any]:
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
    return data


@click.command(cls=CeleryCommand)
@selection_options(CANCEL_SOURCES)
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


@click.command(cls=CeleryCommand)
@selection_options(RETRY_SOURCES)
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


@click.command(cls=CeleryCommand)
@selection_options(FORGET_SOURCES)
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


__all__ = ["cancel", "forget", "retry"]
