"""Confirmation before a change chosen by a filter, or a prune: asked on stderr, so
``--json`` output stays clean, and refused when nobody can answer.

Whether someone can answer is asked of the check the ``resilient`` group puts in click's
context (``celery_resilient.cli._interactive``, which tests replace); a command run outside
the group asks whether stdin is a terminal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

#: The ``ctx.meta`` key of the check "can someone answer a prompt?".
CAN_ANSWER = "celery_resilient.cli.can_answer"


def stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


def confirm(question: str, what: str) -> None:
    """Ask ``question``; refuse (nothing changed) on no, or without a terminal."""
    can_answer: Callable[[], bool] = click.get_current_context().meta.get(
        CAN_ANSWER, stdin_is_terminal)
    if not can_answer():
        raise click.ClickException(
            f"{what} asks for confirmation, and stdin is not a terminal: nothing was changed. "
            "Pass --yes to confirm, or --dry-run to list what it would do")
    try:
        yes = click.confirm(question, default=False, err=True)
    except click.Abort:  # end of input, or Ctrl-C
        yes = False
    if not yes:
        raise click.ClickException("not confirmed: nothing was changed")


__all__ = ["CAN_ANSWER", "confirm", "stdin_is_terminal"]
