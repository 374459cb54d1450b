"""Catch-up policy: which missed slots are sent and which are skipped. Pure.

Global defaults come from ``resilient_catchup*`` settings; an entry overrides any of them with
the same names in its ``options``::

    app.conf.beat_schedule = {"report": {
        "task": "proj.report", "schedule": crontab(minute=0),
        "options": {"resilient_catchup": "latest", "resilient_catchup_max_slots": 24,
                    "resilient_catchup_deadline": 6 * 3600, "resilient_catchup_grace": 60},
    }}

These options are removed before the task is sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from celery_resilient.beat.windows import US
from celery_resilient.errors import ScheduleError
from celery_resilient.runtime.config import CATCHUP_POLICIES, ResilientConfig

OPTION_PREFIX = "resilient_"
OPTION_KEYS = ("resilient_catchup", "resilient_catchup_max_slots",
               "resilient_catchup_deadline", "resilient_catchup_grace")

# Why a slot was not sent (logged with action "slot_skipped").
POLICY, DEADLINE, CAP = "policy", "deadline", "cap"


@dataclass(frozen=True)
class CatchupPolicy:
    """How missed slots of one entry are treated.

    ``mode``: ``all`` sends every missed slot, ``latest`` only the most recent, ``skip`` none.
    ``max_slots``: at most this many missed slots are sent (the most recent ones).
    ``deadline``: a slot later than this many seconds is skipped, whatever the mode.
    ``grace``: a slot sent within this many seconds of its time while beat runs is on time,
    not missed; slots due before beat started or took over the lock are always missed.
    """

    mode: str = "all"
    max_slots: int = 1000
    deadline: float | None = None
    grace: float = 30.0

    @classmethod
    def from_config(cls, config: ResilientConfig) -> CatchupPolicy:
        return cls(config.catchup, config.catchup_max_slots, config.catchup_deadline,
                   config.catchup_grace)

    def for_options(self, options: Mapping[str, Any] | None, entry: str) -> CatchupPolicy:
        """This policy with the entry's ``resilient_catchup*`` options applied (validated)."""
        if not options:
            return self
        changes: dict[str, Any] = {}
        for key, value in options.items():
            if not (isinstance(key, str) and key.startswith("resilient_")):
                continue
            if key not in OPTION_KEYS:
                raise ScheduleError(f"beat entry {entry!r}: unknown option {key!r}; "
                                    f"known: {', '.join(OPTION_KEYS)}")
            field = key[len("resilient_catchup"):].lstrip("_") or "mode"
            changes[field] = _check(entry, key, field, value)
        return replace(self, **changes) if changes else self


def _check(entry: str, key: str, field: str, value: Any) -> Any:
    def bad(why: str) -> ScheduleError:
        return ScheduleError(f"beat entry {entry!r}: option {key}={value!r} is invalid: {why}")

    if field == "mode":
        if value not in CATCHUP_POLICIES:
            raise bad(f"use one of {', '.join(CATCHUP_POLICIES)}")
        return value
    if field == "max_slots":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad("use a positive integer")
        return value
    if field == "deadline" and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value <= 0:
        raise bad("use a positive number of seconds" + (" or None" if field == "deadline"
                                                         else ""))
    return float(value)


def strip_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The entry's options without ours, fit to pass to ``apply_async``."""
    return {k: v for k, v in options.items()
            if not (isinstance(k, str) and k.startswith("resilient_catchup"))}


@dataclass(frozen=True)
class Decision:
    """What to do with the slots of a window: send some, skip the rest (with the reason)."""

    send: tuple[int, ...]
    skipped: tuple[tuple[int, str], ...]
    dropped: int  # skipped slots older than the listed ones (beyond max_slots), not listed
    missed: int  # how many of the window's slots counted as missed (late)


def decide(policy: CatchupPolicy, slots: Sequence[int], total: int, now: int,
           started: int) -> Decision:
    """Apply ``policy`` to the latest ``slots`` of a window holding ``total`` slots.

    ``now`` and ``started`` (when this beat reconciled: start or lock takeover) are
    microseconds. A slot is missed if it was due before ``started`` or is later than grace.
    """
    grace = round(policy.grace * US)
    deadline = None if policy.deadline is None else round(policy.deadline * US)
    dropped = total - len(slots)
    skipped: list[tuple[int, str]] = []
    candidates: list[int] = []
    missed = dropped
    for s in slots:
        late = s < started or now - s > grace
        missed += late
        if deadline is not None and now - s > deadline:
            skipped.append((s, DEADLINE))
        elif late and policy.mode == "skip":
            skipped.append((s, POLICY))
        else:
            candidates.append(s)
    if policy.mode == "latest" and len(candidates) > 1 and (
            dropped or any(s < started or now - s > grace for s in candidates)):
        skipped.extend((s, POLICY) for s in candidates[:-1])
        candidates = candidates[-1:]
    if len(candidates) > policy.max_slots:
        cut = len(candidates) - policy.max_slots
        skipped.extend((s, CAP) for s in candidates[:cut])
        candidates = candidates[cut:]
    skipped.sort()
    return Decision(tuple(candidates), tuple(skipped), dropped, missed)
