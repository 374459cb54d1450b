"""Options several commands share, and durations as operators write them (``7d``, ``12h``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import click

from celery_resilient.core.states import ALL_STATES

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


def duration(value: str, option: str) -> float:
    """``value`` as seconds, or a usage error naming ``option`` and the problem."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{option}'") from None


option_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
option_yes = click.option("--yes", "-y", is_flag=True,
                          help="Do not ask for confirmation (needed when stdin is not a "
                               "terminal).")


def selection_options(sources: Sequence[str]) -> Callable[[Callable[..., Any]],
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


__all__ = ["STATES", "duration", "option_json", "option_yes", "parse_duration",
           "selection_options"]
