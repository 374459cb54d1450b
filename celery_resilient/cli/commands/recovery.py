"""``recover``: re-publish orphans now instead of at the next worker's sweep."""

from __future__ import annotations

from collections.abc import Sequence

import click
from celery.bin.base import CeleryCommand

from celery_resilient.cli import context
from celery_resilient.cli.options import option_json
from celery_resilient.cli.output import echo_json, json_errors, table
from celery_resilient.ops import orphans, reports
from celery_resilient.store.admin_queries import OrphanCandidate

#: The owner name the sweep runs under when no --node is given: ``resilient-cli@<host>``.
ACTOR = "resilient-cli"


@click.command(cls=CeleryCommand)
@click.option("--dry-run", is_flag=True, help="List what would be re-published; change nothing.")
@click.option("--node", default=None,
              help="Also take back every open claim of this worker node at once. Only for a "
                   "node that is down for good: a live node's running work would be fenced.")
@option_json
@click.pass_context
def recover(ctx: click.Context, dry_run: bool, node: str | None, as_json: bool) -> None:
    """Re-publish orphaned work now (open claims whose lease expired), with its task id."""
    with json_errors(as_json):
        rt, store = context.store(ctx, as_json)
        listed = context.run(lambda: orphans.candidates(rt, store, node))
        now = listed.now
        if dry_run:
            if as_json:
                echo_json({"dry_run": True, "would_republish": [
                    orphans.candidate_json(c, now) for c in listed.rows]})
                return
            click.echo(f"{len(listed.rows)} orphan(s) would be re-published"
                       + (" (first batch)" if listed.full else ""))
            _show_candidates(listed.rows, now)
            return
        ctx.call_on_close(rt.store.dispose)  # the sweep uses the app's store
        done = context.run(lambda: orphans.recover(rt, listed, node, ACTOR))
        if as_json:
            echo_json({"dry_run": False,
                       "republished": [orphans.orphan_json(o) for o in done.sent],
                       "not_republished": [orphans.candidate_json(c, now)
                                           for c in done.missed],
                       "more": done.more})
            return
        click.echo(f"re-published {len(done.sent)} orphan(s)")
        table(("work key", "task", "task id", "was", "previous owner"),
              [(o.work_key, o.task_name, o.task_id, o.previous_state, o.previous_owner)
               for o in done.sent])
        if done.missed:
            click.echo(f"{len(done.missed)} listed before but not re-published here (no "
                       "stored message, publish failed, or taken by a worker's sweeper "
                       "meanwhile; see the log):")
            _show_candidates(done.missed, now)
        if done.more:
            click.echo(f"a full batch (resilient_sweep_batch={done.batch}) was sent: run "
                       "again for more")


def _show_candidates(candidates: Sequence[OrphanCandidate], now: float) -> None:
    table(("work key", "task", "state", "owner", "why", "death", "message"),
          [(c.work_key, c.task_name, c.state, c.owner_node,
            "node gone" if c.reason == "node_gone"
            else f"lease expired {reports.span(now - (c.lease_expires_at or now))} ago",
            "yes" if c.state == "running" else "no",
            "stored" if c.has_message else "MISSING") for c in candidates])


__all__ = ["recover"]
