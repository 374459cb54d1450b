"""``prune``: delete old ended work, asked for, counted and confirmed."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from celery_resilient.cli import context
from celery_resilient.cli.options import duration, option_json, option_yes
from celery_resilient.cli.output import echo_json, json_errors
from celery_resilient.cli.prompt import confirm
from celery_resilient.ops import reports, retention
from celery_resilient.store.engine import sanitize_url


@click.command(cls=CeleryCommand)
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
    with json_errors(as_json):
        if older_than is None:
            raise click.UsageError("--older-than is required (e.g. --older-than 30d)")
        seconds = duration(older_than, "--older-than")
        rt, store = context.store(ctx, as_json)
        lease = rt.config.lease_seconds
        if dry_run:
            pruned = context.run(lambda: retention.count(store, seconds, ledger, lease))
        elif yes:
            pruned = context.run(lambda: retention.prune(store, seconds, ledger, lease))
        else:
            pruned = context.run(lambda: retention.count(store, seconds, ledger, lease))
            if pruned.total:  # with nothing to delete there is nothing to confirm
                confirm(f"delete {pruned.summary()}, older than {reports.span(seconds)}?",
                        "prune")
                pruned = context.run(lambda: retention.prune(store, seconds, ledger, lease))
    if as_json:
        echo_json({"store": sanitize_url(rt.config.store_url), "dry_run": dry_run,
                   "older_than_s": seconds, "ledger": ledger,
                   ("would_delete" if dry_run else "deleted"): pruned.as_dict()})
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"older than {reports.span(seconds)}: {verb} {pruned.summary()}"
               + ("" if ledger else " (ledger markers kept: --ledger deletes them)"))


__all__ = ["prune"]
