"""Missed-slot maths, without Redis or a store."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_resilient.beat import windows as w

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def us(*args: int, tz: timezone | ZoneInfo = UTC) -> int:
    return w.to_us(datetime(*args, tzinfo=tz))


def local(slots: tuple[int, ...] | list[int], tz: ZoneInfo) -> list[str]:
    return [w.from_us(s, tz).strftime("%m-%d %H:%M%z") for s in slots]


@pytest.fixture
def app() -> Celery:
    a = Celery("windows-test")
    a.conf.timezone = "Europe/Berlin"
    return a


def test_epoch_round_trip_is_exact() -> None:
    for value in (0, 1, 1_750_000_000_123_457, 4_102_444_800_999_999):
        assert w.from_seconds(w.to_seconds(value)) == value
        assert w.to_us(w.from_us(value)) == value


def test_interval_slots_stay_on_the_anchor_grid() -> None:
    every = schedule(timedelta(seconds=2))
    anchor = us(2024, 1, 1, 0, 0, 0) + 123_456
    missed = w.slots_between(every, anchor, anchor + 10_999_999, 100)
    assert missed.total == 5
    assert missed.slots == tuple(anchor + k * 2_000_000 for k in range(1, 6))
    # A later window continues from the last slot, not from when it was sent.
    again = w.slots_between(every, missed.slots[-1], anchor + 15_000_000, 100)
    assert again.slots == (anchor + 12_000_000, anchor + 14_000_000)
    assert w.next_slot(every, missed.slots[-1]) == anchor + 12_000_000


def test_interval_window_edges_and_limit() -> None:
    every = schedule(timedelta(seconds=1))
    assert w.slots_between(every, 0, 0, 10).total == 0
    assert w.slots_between(every, 0, 999_999, 10).total == 0
    assert w.slots_between(every, 0, 1_000_000, 10).slots == (1_000_000,)  # until inclusive
    many = w.slots_between(every, 0, 86_400 * 1_000_000, 3)
    assert many.total == 86_400
    assert many.dropped == 86_397
    assert many.slots == tuple(s * 1_000_000 for s in (86_398, 86_399, 86_400))


def test_interval_ignores_dst() -> None:
    hourly = schedule(timedelta(hours=1))
    before = us(2024, 3, 31, 0, 0, tz=BERLIN)
    missed = w.slots_between(hourly, before, before + 4 * 3_600_000_000, 10)
    assert local(missed.slots, BERLIN) == ["03-31 01:00+0100", "03-31 03:00+0200",
                                           "03-31 04:00+0200", "03-31 05:00+0200"]


def test_crontab_spring_forward_gap_fires_after_the_jump(app: Celery) -> None:
    cron = crontab(minute=30, app=app)
    missed = w.slots_between(cron, us(2024, 3, 31, 0, 0, tz=BERLIN),
                             us(2024, 3, 31, 5, 0, tz=BERLIN), 100, BERLIN)
    # 02:30 does not exist: it maps to 03:30 CEST, which is also a slot: one run there.
    assert local(missed.slots, BERLIN) == ["03-31 00:30+0100", "03-31 01:30+0100",
                                           "03-31 03:30+0200", "03-31 04:30+0200"]
    assert missed.total == 4


def test_crontab_daily_job_in_the_gap_still_runs_that_day(app: Celery) -> None:
    cron = crontab(minute=30, hour=2, app=app)
    missed = w.slots_between(cron, us(2024, 3, 30, 12, 0, tz=BERLIN),
                             us(2024, 4, 1, 12, 0, tz=BERLIN), 100, BERLIN)
    assert local(missed.slots, BERLIN) == ["03-31 03:30+0200", "04-01 02:30+0200"]


def test_crontab_fall_back_repeated_hour_fires_once(app: Celery) -> None:
    cron = crontab(minute="0,30", hour="1-3", app=app)
    start, end = us(2024, 10, 27, 0, 0, tz=BERLIN), us(2024, 10, 27, 4, 0, tz=BERLIN)
    missed = w.slots_between(cron, start, end, 100, BERLIN)
    assert local(missed.slots, BERLIN) == [
        "10-27 01:00+0200", "10-27 01:30+0200", "10-27 02:00+0200", "10-27 02:30+0200",
        "10-27 03:00+0100", "10-27 03:30+0100"]
    assert len(set(missed.slots)) == missed.total == 6


def test_crontab_uses_the_given_timezone() -> None:
    cron = crontab(minute=0, hour=9)
    after = us(2024, 7, 1, 0, 0)
    ny = w.next_slot(cron, after, NEW_YORK)
    assert ny is not None and w.from_us(ny, NEW_YORK).strftime("%H:%M%z") == "09:00-0400"
    berlin = w.next_slot(cron, after, BERLIN)
    assert berlin is not None and w.from_us(berlin).hour == 7


def test_crontab_day_of_week_and_month_both_match(app: Celery) -> None:
    first_monday = crontab(minute=0, hour=0, day_of_week=1, day_of_month="1-7", app=app)
    missed = w.slots_between(first_monday, us(2024, 1, 1, 1, 0, tz=BERLIN),
                             us(2024, 12, 31, 0, 0, tz=BERLIN), 100, BERLIN)
    assert missed.total == 11  # Jan 1 2024 (a Monday) is before the window
    assert all(w.from_us(s, BERLIN).day <= 7 and w.from_us(s, BERLIN).weekday() == 0
               for s in missed.slots)


def test_crontab_count_over_a_long_window_matches_enumeration(app: Celery) -> None:
    cron = crontab(minute="*/15", app=app)
    start, end = us(2024, 1, 1, 0, 7, tz=BERLIN), us(2024, 12, 31, 23, 50, tz=BERLIN)
    few = w.slots_between(cron, start, end, 3, BERLIN)
    every = w.slots_between(cron, start, end, 10**6, BERLIN)
    assert few.total == every.total == len(every.slots)
    assert few.slots == every.slots[-3:]
    assert list(every.slots) == sorted(set(every.slots))
    # 366 days x 96, one hour lost in spring (4 slots), the repeated hour counted once.
    assert every.total == 366 * 96 - 4 - 1  # minus 00:00 on Jan 1 before 00:07


def test_crontab_matches_celery_next_run_away_from_dst(app: Celery) -> None:
    cron = crontab(minute="5,35", hour="*/3", app=app)
    cursor = us(2024, 5, 1, 0, 0, tz=BERLIN)
    for _ in range(20):
        last = w.from_us(cursor, BERLIN)
        ours = w.next_slot(cron, cursor, BERLIN)
        assert ours is not None
        cron.nowfun = lambda last=last: last  # type: ignore[misc]
        theirs = last + cron.remaining_estimate(last)
        assert ours == w.to_us(theirs)
        cursor = ours


def test_solar_events_are_daily_and_stable() -> None:
    ephem = pytest.importorskip("ephem")
    assert ephem
    from celery.schedules import solar

    sunrise = solar("sunrise", 52.52, 13.40, app=Celery("solar-test"))
    after = us(2024, 6, 1, 0, 0)
    missed = w.slots_between(sunrise, after, after + 3 * 86_400_000_000, 10)
    assert missed.total == 3
    hours = [w.from_us(s).strftime("%H:%M") for s in missed.slots]
    assert all(h.startswith("02:4") for h in hours), hours  # ~04:45 CEST in Berlin
    assert all(s % 1_000_000 == 0 for s in missed.slots)  # whole seconds: a stable identity
    assert w.next_slot(sunrise, missed.slots[0]) == missed.slots[1]


def test_solar_polar_night_has_no_slot() -> None:
    pytest.importorskip("ephem")
    from celery.schedules import solar

    tromso = solar("sunrise", 69.65, 18.96, app=Celery("solar-test"))
    polar = w.slots_between(tromso, us(2024, 12, 5, 0, 0), us(2024, 12, 20, 0, 0), 100)
    assert polar.total == 0
    nxt = w.next_slot(tromso, us(2024, 12, 5, 0, 0))
    assert nxt is not None and w.from_us(nxt).month == 1


def test_generic_schedule_is_stepped_through_its_estimate() -> None:
    from redbeat.schedules import rrule

    r = rrule("MINUTELY", interval=10, dtstart=datetime(2024, 1, 1, tzinfo=UTC), app=Celery())
    missed = w.slots_between(r, us(2024, 1, 1, 0, 5), us(2024, 1, 1, 1, 0), 100)
    assert [w.from_us(s).strftime("%H:%M") for s in missed.slots] == [
        "00:10", "00:20", "00:30", "00:40", "00:50", "01:00"]


def test_latest_slot() -> None:
    every = schedule(timedelta(seconds=5))
    assert w.latest_slot(every, 0, 4_999_999) is None
    assert w.latest_slot(every, 0, 23_000_000) == 20_000_000
