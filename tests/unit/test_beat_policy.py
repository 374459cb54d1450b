"""Catch-up policies, per-entry overrides, slot identities and beat liveness: pure logic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from celery_resilient.beat.policy import CAP, DEADLINE, POLICY, CatchupPolicy, decide, strip_options
from celery_resilient.beat.scheduler import task_id_for, work_key_for
from celery_resilient.core import liveness
from celery_resilient.errors import ScheduleError
from celery_resilient.runtime.config import ResilientConfig

S = 1_000_000
NOW = 1_000 * S
STARTED = 990 * S  # beat reconciled 10 s ago
SLOTS = [980 * S, 985 * S, 990 * S, 995 * S, 1000 * S]  # three missed, two on time


def test_all_sends_every_slot() -> None:
    d = decide(CatchupPolicy("all"), SLOTS, len(SLOTS), NOW, STARTED)
    assert d.send == tuple(SLOTS) and d.skipped == () and d.missed == 2


def test_latest_sends_only_the_latest() -> None:
    d = decide(CatchupPolicy("latest"), SLOTS[:3], 3, NOW, 1_000 * S)
    assert d.send == (990 * S,)
    assert d.skipped == ((980 * S, POLICY), (985 * S, POLICY))


def test_latest_with_nothing_missed_sends_everything_on_time() -> None:
    d = decide(CatchupPolicy("latest"), SLOTS[3:], 2, NOW, STARTED)
    assert d.send == (995 * S, 1000 * S)


def test_skip_sends_only_on_time_slots() -> None:
    d = decide(CatchupPolicy("skip"), SLOTS, len(SLOTS), NOW, STARTED)
    assert d.send == (990 * S, 995 * S, 1000 * S)
    assert [s for s, _ in d.skipped] == [980 * S, 985 * S]


def test_grace_makes_a_stalled_beat_skip() -> None:
    d = decide(CatchupPolicy("skip", grace=4.0), SLOTS, len(SLOTS), NOW, 0)
    assert d.send == (1000 * S,)  # 995 is 5 s late: more than the grace


def test_deadline_skips_old_slots_whatever_the_mode() -> None:
    d = decide(CatchupPolicy("all", deadline=12.0), SLOTS, len(SLOTS), NOW, STARTED)
    assert d.send == (990 * S, 995 * S, 1000 * S)
    assert d.skipped == ((980 * S, DEADLINE), (985 * S, DEADLINE))


def test_cap_keeps_the_latest_and_counts_the_unlisted() -> None:
    d = decide(CatchupPolicy("all", max_slots=2), SLOTS, len(SLOTS) + 7, NOW, STARTED)
    assert d.send == (995 * S, 1000 * S)
    assert d.skipped == ((980 * S, CAP), (985 * S, CAP), (990 * S, CAP))
    assert d.dropped == 7


def test_from_config_and_entry_overrides() -> None:
    base = CatchupPolicy.from_config(ResilientConfig.from_mapping({
        "resilient_store_url": "sqlite://", "resilient_catchup": "latest",
        "resilient_catchup_max_slots": 5, "resilient_catchup_deadline": 60,
        "resilient_catchup_grace": 2}))
    assert base == CatchupPolicy("latest", 5, 60.0, 2.0)
    entry = base.for_options({"queue": "q", "resilient_catchup": "all",
                              "resilient_catchup_max_slots": 9,
                              "resilient_catchup_deadline": None}, "e")
    assert entry == CatchupPolicy("all", 9, None, 2.0)
    assert base.for_options(None, "e") is base


@pytest.mark.parametrize(("option", "value"), [
    ("resilient_catchup", "most"), ("resilient_catchup_max_slots", 0),
    ("resilient_catchup_max_slots", True), ("resilient_catchup_deadline", -1),
    ("resilient_catchup_grace", float("nan")), ("resilient_catchup_typo", 1),
])
def test_invalid_entry_options_are_refused(option: str, value: object) -> None:
    with pytest.raises(ScheduleError, match=f"beat entry 'e'.*{option}"):
        CatchupPolicy().for_options({option: value}, "e")


def test_strip_options_keeps_celery_options() -> None:
    assert strip_options({"queue": "q", "resilient_catchup": "all", "priority": 3}) == {
        "queue": "q", "priority": 3}


def test_slot_identity_is_deterministic_and_bounded() -> None:
    assert task_id_for("rb:e", 5) == task_id_for("rb:e", 5) != task_id_for("rb:e", 6)
    assert work_key_for("rb:e", 5 * S) == "beat:rb:e@1970-01-01T00:00:05+00:00"
    long_key = work_key_for("rb:" + "x" * 400, 5 * S)
    assert len(long_key) <= 255 and long_key.endswith("@1970-01-01T00:00:05+00:00")


def test_liveness_proves_only_what_it_can() -> None:
    me = liveness.current()
    assert not liveness.is_dead(me)
    child = subprocess.Popen([sys.executable, "-c",
                              "from celery_resilient.core import liveness;"
                              "print(liveness.current(), flush=True);"
                              "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdin is not None
    theirs = child.stdout.readline().strip()
    assert not liveness.is_dead(theirs), "a live process on this host"
    child.stdin.close()
    child.wait(10)
    child.stdout.close()
    assert liveness.is_dead(theirs), "its process exited"
    host, boot, ns, pid, started, tag = theirs.split(liveness.SEP)
    other_host = liveness.SEP.join(["elsewhere", boot, ns, pid, started, tag])
    assert not liveness.is_dead(other_host), "another host cannot be proven dead"
    other_boot = liveness.SEP.join([host, "00000000", ns, pid, started, tag])
    assert not liveness.is_dead(other_boot), (
        "another boot id under this host name may be a second machine with the same name")
    reused = liveness.SEP.join([host, boot, ns, str(os.getpid()), "1", tag])
    assert liveness.is_dead(reused), "same PID, different process start"
    assert not liveness.is_dead(None) and not liveness.is_dead("garbage")
