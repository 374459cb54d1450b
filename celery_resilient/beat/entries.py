"""RedBeat's entries as this beat reads and writes them, and the definition the store keeps.

RedBeat keeps an entry as a Redis hash (``definition``, ``meta``) scored in its schedule zset.
The beat reads many hashes in one round trip, writes ``meta`` and the score from the store's
marker (``last_run_at`` is the last slot, so RedBeat's due time stays on the schedule's grid),
and keeps each entry's definition in the store, wrapped with whether it is static (from
``beat_schedule``) or dynamic (added through RedBeat's API), so a lost entry can be rebuilt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime, timedelta, tzinfo
from typing import Any

from celery import Celery
from redbeat.decoder import RedBeatJSONEncoder
from redbeat.schedulers import RedBeatSchedulerEntry

from celery_resilient.beat.windows import US, to_us
from celery_resilient.errors import ScheduleError

#: RedBeat's ``definition`` and ``meta`` of an entry's hash (None where missing).
Hash = tuple[str | None, str | None]


def key_prefix(app: Celery) -> str:
    """RedBeat's key prefix (``redbeat_key_prefix``): every entry key of this app starts so."""
    prefix: str = app.redbeat_conf.key_prefix
    return prefix


def read_hashes(client: Any, keys: Iterable[str]) -> dict[str, Hash]:
    """RedBeat's ``definition`` and ``meta`` of each key, in one round trip."""
    keys = list(keys)
    if not keys:
        return {}
    with client.pipeline() as pipe:
        for key in keys:
            pipe.hmget(key, "definition", "meta")
        values = pipe.execute()
    return {k: (v[0], v[1]) for k, v in zip(keys, values, strict=True)}


def put_meta(pipe: Any, schedule_key: str, key: str, last_run_at: datetime,
             total_run_count: int, nxt: int | None) -> None:
    """Queue on ``pipe`` an entry's RedBeat meta and its score (its next slot; -1: none)."""
    meta = {"last_run_at": last_run_at, "total_run_count": total_run_count}
    pipe.hset(key, "meta", json.dumps(meta, cls=RedBeatJSONEncoder))
    pipe.zadd(schedule_key, {key: -1 if nxt is None else nxt / US})


def first_marker(last_run_at: Any, now: int) -> int:
    """The marker of an entry the store does not know yet: RedBeat's ``last_run_at`` (never
    later than now), else now."""
    return min(to_us(last_run_at), now) if isinstance(last_run_at, datetime) else now


def schedule_tz(sched: Any) -> tzinfo | None:
    """The timezone an entry's schedule reads its fields in (None: UTC)."""
    try:
        tz: tzinfo | None = sched.tz
    except Exception:  # a schedule without an app or tz: crontab fields then mean UTC
        return None
    return tz


def check_interval(name: str, sched: Any) -> None:
    """An interval schedule must repeat after a positive time (0 would fire forever)."""
    every = getattr(sched, "run_every", sched)
    seconds = every.total_seconds() if isinstance(every, timedelta) else every
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds <= 0:
        raise ScheduleError(f"beat entry {name!r}: schedule {sched!r} is invalid: an interval "
                            "schedule must repeat after a positive number of seconds")


def definition_json(entry: RedBeatSchedulerEntry, static: bool) -> str | None:
    """The stored form of ``entry``'s definition; None if RedBeat cannot encode it."""
    try:
        definition = json.dumps({
            "name": entry.name, "task": entry.task, "args": entry.args,
            "kwargs": entry.kwargs, "options": entry.options, "schedule": entry.schedule,
            "enabled": entry.enabled,
        }, cls=RedBeatJSONEncoder)
    except (TypeError, ValueError):
        return None
    return wrap(definition, static)


def wrap(definition: str, static: bool) -> str:
    """The stored form of RedBeat's ``definition`` JSON."""
    return json.dumps({"static": static, "definition": definition}, sort_keys=True)


def unwrap(text: str | None) -> tuple[bool, str | None]:
    """``(static, RedBeat's definition JSON or None)`` of a stored definition."""
    data = load_object(text)
    definition = data.get("definition")
    return bool(data.get("static")), definition if isinstance(definition, str) else None


def load_object(text: str | None) -> dict[str, Any]:
    """A JSON object, or ``{}`` for anything else (missing, unreadable, not an object)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["Hash", "check_interval", "definition_json", "first_marker", "key_prefix",
           "load_object", "put_meta", "read_hashes", "schedule_tz", "unwrap", "wrap"]
