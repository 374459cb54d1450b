"""``celery -A proj resilient <command>``: operate the store from Celery's own CLI.

``migrate`` creates or upgrades the schema; ``status``, ``work``, ``schedule`` and every
``--dry-run`` only read; ``recover`` re-publishes orphans now; ``cancel``, ``retry`` and
``forget`` stop, re-run or delete chosen work; ``prune`` deletes old ended work (and, only
when asked, old ledger markers). Commands that change work chosen by a filter, and ``prune``,
ask for confirmation unless ``--yes``. Human tables by default, ``--json`` for scripts.
Store URLs are shown with their password masked. See ``docs/operations.md``.

This module is the group Celery finds through the ``celery.commands`` entry point; the
commands are in :mod:`.commands`, the work they do in :mod:`celery_resilient.ops`.
"""

from __future__ import annotations

import click
from celery.bin.base import handle_preload_options

from celery_resilient.cli import prompt
from celery_resilient.cli.commands.actions import cancel, forget, retry
from celery_resilient.cli.commands.inspection import schedule, status, work
from celery_resilient.cli.commands.recovery import recover
from celery_resilient.cli.commands.retention import prune
from celery_resilient.cli.commands.schema import migrate
from celery_resilient.cli.options import parse_duration


def _interactive() -> bool:
    """Whether someone can answer a prompt (tests replace this)."""
    return prompt.stdin_is_terminal()


@click.group(name="resilient", cls=click.Group)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def resilient(ctx: click.Context) -> None:
    """celery-resilient: migrate, inspect, recover, cancel, retry, forget and prune the
    durable store."""
    ctx.meta[prompt.CAN_ANSWER] = _interactive  # read here, so a replaced one is used


for _command in (migrate, status, work, recover, prune, cancel, retry, forget, schedule):
    resilient.add_command(_command)


__all__ = ["parse_duration", "resilient"]
