"""ResilientScheduler under real ``celery beat`` and ``celery worker`` processes, SIGKILLed.

The effect log (one line per task run, naming the slot it served) is the witness; the store's
slot rows and the beat's recovery log lines say why. Every test has its own RedBeat key prefix,
queue and table prefix, so tests never see each other's schedule.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

import pytest
import redis
from celery import Celery
from redbeat.schedulers import RedBeatSchedulerEntry

from celery_resilient.beat.scheduler import KILL_AFTER_CLAIM_ENV, task_id_for, work_key_for
from celery_resilient.beat.windows import from_seconds, from_us, to_us
from celery_resilient.store.schedule import ScheduleStore
from celery_resilient.store.sql import Store
from celery_resilient.testing import EffectLog, LocalBeat, LocalWorker, wait_for
from celery_resilient.testing.plugin import NodeFactory

pytestmark = pytest.mark.e2e

APP = "tests.e2e.beatproj"
SCHEDULER = "celery_resilient.beat:ResilientScheduler"
STEP = 1.0  # most tests: short slots keep the suite fast


class BeatProject:
    """One isolated beat setup: Redis prefix, queue, store tables, schedule and settings."""

    def __init__(self, nodes: NodeFactory, redis_url: str, store_url: str, table_prefix: str,
                 queue: str, effects: EffectLog) -> None:
        self.nodes = nodes
        self.redis_url = redis_url
        self.prefix = f"rb-{uuid.uuid4().hex[:8]}:"
        self.queue = queue
        self.table_prefix = table_prefix
        self.store_url = store_url
        self.effects = effects
        self.step = STEP
        self.schedule: dict[str, dict[str, Any]] = {"tick": {"every": STEP}}
        self.extra: dict[str, Any] = {}
        self.store = Store(store_url, table_prefix)
        self.store.migrate()
        self.slots = ScheduleStore(self.store)
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self._beats = 0

    def env(self, **more: str) -> dict[str, str]:
        return {"RESILIENT_BROKER": self.redis_url, "RESILIENT_STORE_URL": self.store_url,
                "RESILIENT_TABLE_PREFIX": self.table_prefix, "RESILIENT_QUEUE": self.queue,
                "RESILIENT_BEAT_PREFIX": self.prefix,
                "RESILIENT_BEAT_SCHEDULE": json.dumps(self.schedule),
                "RESILIENT_EXTRA": json.dumps(self.extra), **more}

    def worker(self) -> LocalWorker:
        return self.nodes.worker(APP, queues=(self.queue,), concurrency=2, env=self.env())

    def beat(self, start: bool = True, **env: str) -> LocalBeat:
        self._beats += 1
        node = self.nodes.beat(APP, name=f"beat{self._beats}", scheduler=SCHEDULER,
                               env=self.env(**env), start=False)
        if start:
            node.start()
        return node

    def key(self, entry: str = "tick") -> str:
        return self.prefix + entry

    def runs(self, entry: str = "tick") -> list[datetime]:
        """The slot of every run of ``entry``, in the order the runs happened."""
        return [datetime.fromisoformat(e["slot"]) for e in self.effects.entries()
                if e.get("entry") == entry]

    def ran_through(self, until: float, entry: str = "tick") -> bool:
        return any(s.timestamp() >= until for s in self.runs(entry))

    def wipe_redis(self) -> None:
        keys = list(self.redis.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            self.redis.delete(*keys)

    def close(self) -> None:
        self.wipe_redis()
        self.redis.close()
        self.store.dispose()


@pytest.fixture
def beatproj(table_prefix: str, resilient_nodes: NodeFactory, redis_url: str, pg_url: str,
             queue_name: str, effect_log: EffectLog) -> Iterator[BeatProject]:
    project = BeatProject(resilient_nodes, redis_url, pg_url, table_prefix, queue_name,
                          effect_log)
    yield project
    project.close()


def assert_each_slot_once(project: BeatProject, entry: str = "tick") -> list[datetime]:
    """No slot ran twice; every run carries its own slot, task id and work key."""
    runs = project.runs(entry)
    dup = {s: n for s, n in Counter(runs).items() if n > 1}
    assert not dup, f"slots run more than once: {dup}"
    key = project.key(entry)
    for e in project.effects.entries():
        if e.get("entry") != entry:
            continue
        slot = to_us(datetime.fromisoformat(e["slot"]))
        assert e["task_id"] == task_id_for(key, slot)
        assert e["work_key"] == work_key_for(key, slot)
    return sorted(runs)


def wait_sent_ran(project: BeatProject, entry: str = "tick") -> None:
    """Wait until every slot recorded sent has run (the worker may finish them out of order)."""
    def done() -> bool:
        sent = {r.slot for r in project.slots.runs_of(project.key(entry)) if r.state == "sent"}
        ran = {s.timestamp() for s in project.runs(entry)}
        return all(any(abs(x - y) < 1e-3 for y in ran) for x in sent)
    wait_for(done, 30, "every sent slot to run")


def assert_on_grid(slots: list[datetime], step: float) -> None:
    """Slots stay on one grid (no drift towards send times)."""
    first = slots[0]
    for s in slots:
        offset = (s - first).total_seconds() / step
        assert abs(offset - round(offset)) < 1e-6, f"slot {s} is off the grid of {first}"


def gaps(slots: list[datetime], step: float) -> list[tuple[datetime, int]]:
    """Where consecutive runs are more than one step apart, and how many slots are missing."""
    out = []
    for a, b in pairwise(slots):
        missing = round((b - a).total_seconds() / step) - 1
        if missing:
            out.append((a, missing))
    return out


def logged(beat: LocalBeat, what: str, step: float = STEP) -> list[str]:
    """Slots (ISO strings) of the beat's recovery log lines of one kind.

    Caught-up slots are logged once per catch-up (``beat: tick: N missed slots caught up:
    FIRST to LAST``): the N slots of a range on the entry's grid of ``step`` seconds.
    """
    if what == "caught_up":
        slots: list[str] = []
        for m in re.finditer(r"beat: tick: (\d+) missed slots? caught up: (\S+)(?: to (\S+))?",
                             beat.process.all_logs()):
            count, first = int(m.group(1)), datetime.fromisoformat(m.group(2))
            last = datetime.fromisoformat(m.group(3) or m.group(2))
            assert (last - first).total_seconds() == pytest.approx((count - 1) * step), m[0]
            slots.extend((first + timedelta(seconds=k * step)).isoformat()
                         for k in range(count))
        return slots
    pattern = {"skipped": r"beat: tick slot (\S+) skipped \((\w+)",
               "resent": r"beat: tick slot (\S+) was claimed by .* re-sent",
               "refused": r"beat: tick slot (\S+) already \w+ by"}[what]
    return [m.group(1) for m in re.finditer(pattern, beat.process.all_logs())]


def kill_and_wait_down(beat: LocalBeat, project: BeatProject, down: float) -> float:
    """SIGKILL beat once it has run a few slots; return when ``down`` seconds have passed."""
    wait_for(lambda: len(project.runs()) >= 2, 30, "two scheduled runs before the kill")
    beat.kill("SIGKILL")
    killed = time.time()
    wait_for(lambda: time.time() - killed >= down, down + 5, f"{down}s of beat downtime")
    return killed


def test_all_missed_slots_run_exactly_once_on_grid(beatproj: BeatProject) -> None:
    """The issue's proof: every 2 s, beat down ~10 s: each missed slot once, no gap."""
    beatproj.step = 2.0
    beatproj.schedule = {"tick": {"every": 2.0}}
    beatproj.worker()
    beat = beatproj.beat()
    killed = kill_and_wait_down(beat, beatproj, 10)
    beat.restart()
    restarted = time.time()
    wait_for(lambda: beatproj.ran_through(restarted + 3 * beatproj.step), 40,
             "runs after the restart")
    beat.kill("SIGKILL")

    slots = assert_each_slot_once(beatproj)
    holes = gaps(slots, beatproj.step)
    assert holes == [], f"missed slots were not caught up: {holes}"
    assert_on_grid(slots, beatproj.step)
    missed = [s for s in slots if killed < s.timestamp() < restarted]
    assert len(missed) >= 4, f"expected >= 4 slots in the 10 s outage, got {missed}"
    caught = {datetime.fromisoformat(s) for s in logged(beat, "caught_up", beatproj.step)}
    assert set(missed) <= caught, "every missed slot is logged as caught up"
    assert logged(beat, "skipped") == []
    rows = {r.slot: r.state for r in beatproj.slots.runs_of(beatproj.key())}
    assert all(rows[s.timestamp()] == "sent" for s in slots)


@pytest.mark.parametrize(("policy", "cap"), [("latest", None), ("skip", None), ("all", 2)])
def test_catchup_policies(beatproj: BeatProject, policy: str, cap: int | None) -> None:
    options: dict[str, Any] = {"resilient_catchup": policy}
    if cap:
        options["resilient_catchup_max_slots"] = cap
    beatproj.schedule = {"tick": {"every": beatproj.step, "options": options}}  # per-entry override
    beatproj.worker()
    beat = beatproj.beat()
    killed = kill_and_wait_down(beat, beatproj, 5)
    beat.restart()
    restarted = time.time()
    wait_for(lambda: beatproj.ran_through(restarted + 2 * beatproj.step), 40,
             "runs after the restart")
    beat.kill("SIGKILL")

    slots = assert_each_slot_once(beatproj)
    assert_on_grid(slots, beatproj.step)
    caught = sorted(datetime.fromisoformat(s) for s in logged(beat, "caught_up"))
    skipped = sorted(datetime.fromisoformat(s) for s in logged(beat, "skipped"))
    assert len(skipped) >= 2, f"the outage's slots were not skipped: {skipped}"
    assert not set(skipped) & set(slots), "a skipped slot ran"
    # The policy applies to every slot due when the restarted beat first ticks: the late ones
    # and, when the tick lands just after a slot, that on-time slot too (it counts as the
    # latest). So: runs among the slots due at that tick = 1 (latest), 2 (cap) or only an
    # on-time one (skip); every late slot is either skipped or caught up.
    tick = first_log_time(beat, "skipped (", start=2)
    # Skipped: slots that fell due from the kill to that first tick (logged just after it
    # decided). A loaded machine can take more than a step from "beat: Starting..." (when
    # the restart returns) to the first tick: the slot due meanwhile is missed too (a CI run).
    assert all(killed - beatproj.step < s.timestamp() <= tick for s in skipped), (
        skipped, killed, restarted, tick)
    took_over = first_log_time(beat, "Acquired lock", start=2)
    due = [s for s in slots if killed < s.timestamp() <= tick]
    if policy == "skip":
        assert caught == [] and all(s.timestamp() >= took_over for s in due), due
    else:
        # The tick skipped the older slots it found due; the ones it ran are the next
        # ``expected`` slots (caught up, or the latest on time). Judged by what the tick
        # decided, not by its log line's time: a slot falling due between the decision and
        # the line (2 ms in a CI run) runs on time at the next tick.
        expected = {"latest": 1, "all": 2}[policy]
        limit = max(skipped).timestamp() + expected * beatproj.step + 0.001
        due = [s for s in slots if killed < s.timestamp() <= limit]
        assert len(due) == expected, f"runs of the slots due at the takeover tick: {due}"
        assert len(caught) <= expected and set(caught) <= set(due), f"caught up {caught}"
    assert all(c > max(skipped) for c in caught), "the latest missed slots are the ones sent"
    # Skipped and sent slots together cover the outage without a hole.
    everything = sorted(set(slots) | set(skipped))
    assert gaps(everything, beatproj.step) == []
    reasons = {m for m in re.findall(r"skipped \((\w+)", beat.process.all_logs())}
    assert reasons == {"cap" if cap else "policy"}


def first_log_time(beat: LocalBeat, text: str, start: int = 1) -> float:
    """Epoch seconds of the first line containing ``text`` in the ``start``-th run's log."""
    log = (beat.process.log_dir / f"{beat.process.name}.{start}.log").read_text()
    for line in log.splitlines():
        if text in line:
            stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", line)
            assert stamp, line
            local = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
            return local.astimezone().timestamp()  # Celery logs local time
    raise AssertionError(f"{text!r} not in the beat's log")


def test_kill_between_claim_and_publish_resends_once(beatproj: BeatProject,
                                                      tmp_path: Any) -> None:
    beatproj.worker()
    marker = tmp_path / "killed-after-claim"
    beat = beatproj.beat(**{KILL_AFTER_CLAIM_ENV: str(marker)})
    wait_for(lambda: beat.process.status == "exited", 30, "beat to kill itself after a claim")
    assert marker.exists()
    pending = [r for r in beatproj.slots.runs_of(beatproj.key()) if r.state == "claimed"]
    assert len(pending) == 1, f"expected exactly one claimed, unsent slot: {pending}"
    lost = from_us(from_seconds(pending[0].slot))
    assert lost not in beatproj.runs(), "the claimed slot was published before the kill"

    beat.restart()  # the kill point is disarmed: its file exists
    wait_for(lambda: lost in beatproj.runs(), 30, "the claimed slot to be re-sent")
    restarted = time.time()
    wait_for(lambda: beatproj.ran_through(restarted + 2 * beatproj.step), 30, "later runs")
    beat.kill("SIGKILL")

    slots = assert_each_slot_once(beatproj)
    assert gaps(slots, beatproj.step) == []
    assert [datetime.fromisoformat(s) for s in logged(beat, "resent")] == [lost]
    row = next(r for r in beatproj.slots.runs_of(beatproj.key()) if r.slot == pending[0].slot)
    assert row.state == "sent" and row.task_id == pending[0].task_id


def test_standby_beat_takes_over_and_every_slot_runs_once(beatproj: BeatProject) -> None:
    beatproj.worker()
    first = beatproj.beat()
    second = beatproj.beat(start=False)
    second.process.start(wait=False)
    wait_for(lambda: "waiting for lock" in second.process.logs(), 30, "the standby to wait")
    wait_for(lambda: len(beatproj.runs()) >= 3, 30, "runs from the first beat")
    first.kill("SIGKILL")
    killed = time.time()
    wait_for(lambda: "taken over" in second.process.logs(), 10, "the standby to take over")
    wait_for(lambda: beatproj.ran_through(killed + 3 * beatproj.step), 30, "runs from the standby")
    second.kill("SIGKILL")
    slots = assert_each_slot_once(beatproj)
    assert gaps(slots, beatproj.step) == []
    assert_on_grid(slots, beatproj.step)


def test_two_beats_without_a_lock_send_every_slot_once(beatproj: BeatProject) -> None:
    """Split brain: no RedBeat lock, and each beat sees its own Redis (as across a partition
    or a failover). Nothing in Redis coordinates them: the store's slot claims alone must."""
    beatproj.extra = {"redbeat_lock_key": None}
    other_redis = re.sub(r"/\d+$", "/10", beatproj.redis_url)
    beatproj.worker()
    a = beatproj.beat()
    b = beatproj.beat(RESILIENT_BEAT_REDIS=other_redis)
    started = time.time()
    try:
        wait_for(lambda: beatproj.ran_through(started + 6 * beatproj.step), 40,
                 "six slots from two beats")
    finally:
        a.kill("SIGKILL")
        b.kill("SIGKILL")
        partitioned = redis.Redis.from_url(other_redis)
        keys = list(partitioned.scan_iter(match=f"{beatproj.prefix}*", count=1000))
        if keys:
            partitioned.delete(*keys)
        partitioned.close()
    slots = assert_each_slot_once(beatproj)
    assert gaps(slots, beatproj.step) == []
    refused = logged(a, "refused") + logged(b, "refused")
    assert len(refused) >= 3, f"the two beats did not both try the slots: {refused}"
    # Every slot either beat refused did run, exactly once.
    assert {s for s in map(datetime.fromisoformat, refused) if s <= slots[-1]} <= set(slots)


def test_restart_at_once_takes_over_dead_lock_promptly(beatproj: BeatProject) -> None:
    beatproj.extra = {"redbeat_lock_timeout": 600}  # RedBeat alone would wait ten minutes
    beatproj.worker()
    beat = beatproj.beat()
    wait_for(lambda: len(beatproj.runs()) >= 2, 30, "runs before the kill")
    beat.kill("SIGKILL")
    assert beatproj.redis.ttl(beatproj.prefix + ":lock") > 500, "the dead beat's lock is held"
    killed = time.time()
    beat.restart()
    wait_for(lambda: beatproj.ran_through(killed + beatproj.step), 10, "a run within seconds")
    took = time.time() - killed
    assert "taken over" in beat.process.logs()
    beat.kill("SIGKILL")
    wait_sent_ran(beatproj)  # the catch-up's slots run in parallel (-c 2), in any order
    slots = assert_each_slot_once(beatproj)
    assert gaps(slots, beatproj.step) == []
    print(f"restarted beat sent its next slot {took:.1f}s after the kill")


def test_redis_lost_while_beat_down_rehydrates_and_catches_up(beatproj: BeatProject) -> None:
    client = Celery("client", broker=beatproj.redis_url)
    client.conf.update(redbeat_redis_url=beatproj.redis_url, redbeat_key_prefix=beatproj.prefix,
                       timezone="UTC")
    beatproj.worker()
    beat = beatproj.beat()
    dynamic = RedBeatSchedulerEntry("dyn", "tests.e2e.beatproj.tick",
                                  timedelta(seconds=beatproj.step),
                                    args=("dyn",), options={"queue": beatproj.queue},
                                    app=client).save()
    wait_for(lambda: len(beatproj.runs("dyn")) >= 2, 30, "runs of the dynamic entry")
    beat.kill("SIGKILL")
    killed = time.time()
    beatproj.wipe_redis()  # every key of this schedule: entries, zset, statics, lock
    assert not beatproj.redis.exists(dynamic.key)
    wait_for(lambda: time.time() - killed >= 4, 10, "downtime")
    beat.restart()
    restarted = time.time()
    wait_for(lambda: beatproj.ran_through(restarted + 2 * beatproj.step, "dyn")
             and beatproj.ran_through(restarted + 2 * beatproj.step), 40,
             "runs after rehydration")
    beat.kill("SIGKILL")
    assert "entry_rehydrated" in beat.process.logs() or "restored from the store" in \
        beat.process.logs()
    for entry in ("tick", "dyn"):
        slots = assert_each_slot_once(beatproj, entry)
        assert gaps(slots, beatproj.step) == [], f"{entry}: {gaps(slots, beatproj.step)}"
        assert_on_grid(slots, beatproj.step)
        assert any(killed < s.timestamp() < restarted for s in slots), f"{entry} not caught up"
    client.close()


def test_redbeat_dynamic_entries_and_settings_still_work(beatproj: BeatProject) -> None:
    client = Celery("client", broker=beatproj.redis_url)
    client.conf.update(redbeat_redis_url=beatproj.redis_url, redbeat_key_prefix=beatproj.prefix,
                       timezone="UTC")
    beatproj.schedule = {}
    beatproj.worker()
    beat = beatproj.beat()
    entry = RedBeatSchedulerEntry("dyn", "tests.e2e.beatproj.tick",
                                  timedelta(seconds=beatproj.step),
                                  args=("dyn",), options={"queue": beatproj.queue},
                                  app=client).save()
    wait_for(lambda: len(beatproj.runs("dyn")) >= 3, 30, "runs of a RedBeat entry")
    # RedBeat's own view: its keys under its prefix, meta last_run_at = the last slot.
    loaded = RedBeatSchedulerEntry.from_key(entry.key, app=client)
    assert loaded.last_run_at in beatproj.runs("dyn") or loaded.last_run_at > max(
        beatproj.runs("dyn"))
    assert beatproj.redis.zscore(f"{beatproj.prefix}:schedule", entry.key) is not None
    assert beatproj.redis.get(f"{beatproj.prefix}:lock"), "RedBeat's lock is held"
    # Deleting through RedBeat's API stops the entry, and it is not resurrected.
    loaded.delete()
    deleted = time.time()
    wait_for(lambda: time.time() - deleted > 2 * beatproj.step + 1, 10,
             "two slots after the delete")
    runs = beatproj.runs("dyn")
    assert not any(s.timestamp() > deleted + 1 for s in runs), "a deleted entry still ran"
    beat.restart()
    wait_for(lambda: "reconciled" in beat.process.logs(), 20, "the restart to reconcile")
    assert not beatproj.redis.exists(entry.key), "a deleted entry was resurrected"
    assert beatproj.slots.marker(entry.key) is None
    beat.kill("SIGKILL")
    assert_each_slot_once(beatproj, "dyn")
    client.close()
