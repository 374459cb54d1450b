"""Missed-slot maths: which scheduled instants fall in a window. Pure: no Redis, no store.

A *slot* is the instant a run was scheduled for, as integer microseconds since the epoch (UTC),
so the same slot computed twice is the same key, bit for bit.

- Interval (``celery.schedules.schedule``): slots lie on a grid ``anchor + k * run_every`` of
  elapsed time. Callers pass the last slot as ``after``, so the grid never drifts towards the
  time a run happened to be sent. DST does not apply: an interval is elapsed time.
- Crontab: wall-clock matches in the schedule's timezone (Celery's AND of day-of-month and
  day-of-week). A wall time that does not exist (the spring-forward gap) fires at the same
  offset after the jump (02:30 -> 03:30) and merges with a slot already there; a wall time that
  occurs twice (fall-back) fires once, at its first occurrence.
- Solar (needs ``ephem``): each event after ``after``, rounded to the second; days on which the
  event does not happen (polar day and night) have no slot.
- Anything else with ``remaining_estimate`` (RedBeat's rrule, custom schedules): stepped through
  its own estimate, bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo
from typing import Any

from celery.schedules import crontab, schedule

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
US = 1_000_000
_ONE_US = timedelta(microseconds=1)
MAX_SEARCH_DAYS = 366 * 29  # Feb 29 on a given weekday recurs within 28 years
MAX_GENERIC_STEPS = 100_000


@dataclass(frozen=True)
class Missed:
    """Slots in a window ``(after, until]``: how many, and the latest ``limit`` of them."""

    total: int
    slots: tuple[int, ...]  # oldest first

    @property
    def dropped(self) -> int:
        """Slots in the window older than the ones listed (beyond the limit)."""
        return self.total - len(self.slots)


def to_us(dt: datetime) -> int:
    """Microseconds since the epoch of an aware datetime (naive counts as UTC)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return (dt - EPOCH) // _ONE_US


def from_us(us: int, tz: tzinfo | None = None) -> datetime:
    dt = EPOCH + timedelta(microseconds=us)
    return dt.astimezone(tz) if tz is not None else dt


def to_seconds(us: int) -> float:
    """The float form the store keeps; :func:`from_seconds` gives back the same integer."""
    return us / US


def from_seconds(seconds: float) -> int:
    return round(seconds * US)


def slots_between(sched: Any, after: int, until: int, limit: int,
                  tz: tzinfo | None = None) -> Missed:
    """Every slot ``s`` of ``sched`` with ``after < s <= until``: the count and the last ``limit``.

    ``tz`` is the timezone crontab fields are read in (default: the schedule's own).
    """
    if until <= after or limit < 0:
        return Missed(0, ())
    if isinstance(sched, schedule) and not isinstance(sched, crontab):
        return _interval_between(sched, after, until, limit)
    if isinstance(sched, crontab):
        return _crontab_between(sched, after, until, limit, tz or _tz_of(sched))
    return _collect(_iter_slots(sched, after, tz), until, limit)


def next_slot(sched: Any, after: int, tz: tzinfo | None = None) -> int | None:
    """The first slot strictly after ``after``, or None if the schedule has no more."""
    if isinstance(sched, schedule) and not isinstance(sched, crontab):
        return after + _step_us(sched)
    for slot in _iter_slots(sched, after, tz):
        return slot
    return None


def latest_slot(sched: Any, after: int, until: int, tz: tzinfo | None = None) -> int | None:
    """The last slot in ``(after, until]``, or None."""
    missed = slots_between(sched, after, until, 1, tz)
    return missed.slots[-1] if missed.slots else None


# -- interval ------------------------------------------------------------------------------

def _step_us(sched: Any) -> int:
    step = round(sched.run_every.total_seconds() * US)
    if step <= 0:
        raise ValueError(f"interval schedule {sched!r} must have a positive run_every")
    return int(step)


def _interval_between(sched: Any, after: int, until: int, limit: int) -> Missed:
    step = _step_us(sched)
    total = (until - after) // step
    first_k = max(1, total - limit + 1)
    return Missed(total, tuple(after + k * step for k in range(first_k, total + 1)))


# -- crontab -------------------------------------------------------------------------------

def _tz_of(sched: Any) -> tzinfo:
    tz: tzinfo = sched.tz
    return tz


def _day_matches(sched: Any, day: date) -> bool:
    return (day.month in sched.month_of_year and day.day in sched.day_of_month
            and day.isoweekday() % 7 in sched.day_of_week)


def _day_slots(sched: Any, day: date, tz: tzinfo) -> list[int]:
    """The instants of one local day's matches, sorted, DST gaps merged."""
    instants = {
        to_us(datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz))
        for hour in sched.hour for minute in sched.minute
    }
    return sorted(instants)


def _day_is_regular(day: date, tz: tzinfo) -> bool:
    """No UTC offset change during this local day: every wall time exists exactly once."""
    start = datetime(day.year, day.month, day.day, tzinfo=tz)
    nxt = day + timedelta(days=1)
    end = datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz)
    return start.utcoffset() == end.utcoffset() == datetime(
        day.year, day.month, day.day, 12, tzinfo=tz).utcoffset()


def _crontab_between(sched: Any, after: int, until: int, limit: int, tz: tzinfo) -> Missed:
    first_day = from_us(after, tz).date()
    last_day = from_us(until, tz).date()
    per_day = len(sched.hour) * len(sched.minute)
    total = 0
    matching: list[date] = []
    day = first_day
    while day <= last_day:
        if _day_matches(sched, day):
            matching.append(day)
            if day in (first_day, last_day) or not _day_is_regular(day, tz):
                total += sum(1 for s in _day_slots(sched, day, tz) if after < s <= until)
            else:
                total += per_day
        day += timedelta(days=1)
    picked: deque[int] = deque()
    for day in reversed(matching):
        if len(picked) >= limit:
            break
        for s in reversed(_day_slots(sched, day, tz)):
            if after < s <= until:
                picked.appendleft(s)
                if len(picked) >= limit:
                    break
    return Missed(total, tuple(picked))


def _crontab_iter(sched: Any, after: int, tz: tzinfo) -> Iterator[int]:
    day = from_us(after, tz).date()
    for _ in range(MAX_SEARCH_DAYS):
        if _day_matches(sched, day):
            for s in _day_slots(sched, day, tz):
                if s > after:
                    yield s
        day += timedelta(days=1)


# -- solar ---------------------------------------------------------------------------------

def _is_solar(sched: Any) -> bool:
    return type(sched).__name__ == "solar" and hasattr(sched, "cal")


def _solar_iter(sched: Any, after: int) -> Iterator[int]:
    ephem = sched.ephem
    cal = sched.cal.copy()
    sun = ephem.Sun()
    kwargs = {"use_center": True} if sched.use_center else {}
    method = getattr(cal, sched.method)
    # Start a minute later: an event rounded down to the second must not be found again.
    start = ephem.Date(from_us(after + 60 * US).replace(tzinfo=None))
    misses = 0
    while misses < 366:
        try:
            event = method(sun, start=start, **kwargs)
        except ephem.CircumpolarError:
            misses += 1
            start = cal.next_antitransit(sun, start=start)
            continue
        misses = 0
        slot = round(to_us(event.datetime().replace(tzinfo=UTC)) / US) * US
        if slot > after:
            yield slot
        start = ephem.Date(event + ephem.minute)


# -- anything else -------------------------------------------------------------------------

def _generic_iter(sched: Any, after: int, tz: tzinfo | None) -> Iterator[int]:
    """Step through ``remaining_estimate`` with the schedule's clock pinned to each slot.

    The clock (``nowfun``) is swapped on the schedule itself for each step and restored at
    once: beat is single-threaded, and some schedules (RedBeat's rrule) cannot be copied.
    """
    cursor = after
    for _ in range(MAX_GENERIC_STEPS):
        point = from_us(cursor, tz)
        saved = sched.__dict__.get("nowfun")
        sched.nowfun = lambda point=point: point
        try:
            delta = sched.remaining_estimate(point)
        finally:
            sched.nowfun = saved
        if delta is None:
            return
        nxt = to_us(point + delta)
        if nxt <= cursor:
            nxt = cursor + US  # a schedule that says "now": check again a second later
        cursor = nxt
        yield nxt


def _interval_iter(sched: Any, after: int) -> Iterator[int]:
    step = _step_us(sched)
    k = 1
    while True:
        yield after + k * step
        k += 1


def _iter_slots(sched: Any, after: int, tz: tzinfo | None) -> Iterator[int]:
    if isinstance(sched, schedule) and not isinstance(sched, crontab):
        return _interval_iter(sched, after)
    if isinstance(sched, crontab):
        return _crontab_iter(sched, after, tz or _tz_of(sched))
    if _is_solar(sched):
        return _solar_iter(sched, after)
    return _generic_iter(sched, after, tz)


def _collect(slots: Iterator[int], until: int, limit: int) -> Missed:
    picked: deque[int] = deque(maxlen=limit) if limit else deque(maxlen=0)
    total = 0
    for s in slots:
        if s > until:
            break
        total += 1
        picked.append(s)
    return Missed(total, tuple(picked))
