"""Each beat slot's task starts once, plain or resumable, across a beat killed between the
publish of a slot and the record that it was sent.

Real ``celery beat`` and ``celery worker`` processes; the beat SIGKILLs itself at the kill
point ``RESILIENT_BEAT_KILL_AFTER_PUBLISH`` (after its 3rd publish), in the middle of a
catch-up batch, while no worker consumes: the broker then holds the published copies, and the
restarted beat re-sends every slot of the batch (the claimed rows). Two copies of three slots
wait in the queue when the worker starts. The effect log (one line per body run, naming its
slot) is the witness: every slot ran exactly once and no slot is missing.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import pytest
import redis

from celery_resilient.beat.scheduler import (
    KILL_AFTER_PUBLISH_ENV,
    KILL_AFTER_PUBLISH_NTH_ENV,
    task_id_for,
)
from celery_resilient.beat.windows import to_seconds, to_us
from celery_resilient.store.schedule import CLAIMED, SENT, STARTED, ScheduleStore
from celery_resilient.store.sql import Store
from celery_resilient.testing import EffectLog, LocalBeat, LocalWorker, wait_for
from celery_resilient.testing.plugin import NodeFactory

pytestmark = pytest.mark.e2e

APP = "tests.e2e.beatonceproj"
SCHEDULER = "celery_resilient.beat:ResilientScheduler"
STEP = 1.0
KILL_AT = 3  # the beat dies after its 3rd publish: three slots exist twice in the broker


class OnceProject:
    """One isolated setup: RedBeat prefix, queue, store tables and a one-entry schedule."""

    def __init__(self, nodes: NodeFactory, redis_url: str, store_url: str, table_prefix: str,
                 queue: str, effects: EffectLog, kind: str) -> None:
        self.nodes = nodes
        self.redis_url = redis_url
        self.prefix = f"rb-{uuid.uuid4().hex[:8]}:"
        self.queue = queue
        self.table_prefix = table_prefix
        self.store_url = store_url
        self.effects = effects
        self.kind = kind
        self.store = Store(store_url, table_prefix)
        self.store.migrate()
        self.slots = ScheduleStore(self.store)
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self._beats = 0

    @property
    def key(self) -> str:
        return self.prefix + "tick"

    def env(self, **more: str) -> dict[str, str]:
        return {"RESILIENT_BROKER": self.redis_url, "RESILIENT_STORE_URL": self.store_url,
                "RESILIENT_TABLE_PREFIX": self.table_prefix, "RESILIENT_QUEUE": self.queue,
                "RESILIENT_BEAT_PREFIX": self.prefix,
                "RESILIENT_BEAT_SCHEDULE": json.dumps(
                    {"tick": {"every": STEP, "task": self.kind}}), **more}

    def worker(self) -> LocalWorker:
        return self.nodes.worker(APP, queues=(self.queue,), concurrency=2, env=self.env())

    def beat(self, **env: str) -> LocalBeat:
        self._beats += 1
        return self.nodes.beat(APP, name=f"beat{self._beats}", scheduler=SCHEDULER,
                               env=self.env(**env))

    def runs(self) -> list[datetime]:
        return [datetime.fromisoformat(e["slot"]) for e in self.effects.entries()
                if e.get("entry") == "tick"]

    def ran(self, slots: list[float]) -> bool:
        done = {to_seconds(to_us(s)) for s in self.runs()}
        return set(slots) <= done

    def rows(self, *states: str) -> list[float]:
        return [r.slot for r in self.slots.runs_of(self.key) if r.state in states]

    def close(self) -> None:
        keys = list(self.redis.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            self.redis.delete(*keys)
        self.redis.close()
        self.store.dispose()


@pytest.fixture(params=["plain", "resumable"])
def once_project(request: pytest.FixtureRequest, resilient_nodes: NodeFactory,
                 redis_url: str, pg_url: str, table_prefix: str, queue_name: str,
                 effect_log: EffectLog) -> Iterator[OnceProject]:
    project = OnceProject(resilient_nodes, redis_url, pg_url, table_prefix, queue_name,
                          effect_log, request.param)
    yield project
    project.close()


def test_slot_published_twice_runs_once(once_project: OnceProject, tmp_path: Path) -> None:
    p = once_project
    worker = p.worker()
    first = p.beat()
    wait_for(lambda: len(p.runs()) >= 2, 30, "two scheduled runs")
    first.kill("SIGKILL")
    killed = time.time()
    # Every slot the first beat published has run; then no worker consumes for a while.
    wait_for(lambda: p.ran(p.rows(SENT, STARTED)), 30, "the first beat's slots to run")
    worker.process.stop()
    wait_for(lambda: time.time() - killed >= 5 * STEP, 10, "five slots of beat downtime")

    marker = tmp_path / "killed-after-publish"
    crashing = p.beat(**{KILL_AFTER_PUBLISH_ENV: str(marker),
                         KILL_AFTER_PUBLISH_NTH_ENV: str(KILL_AT)})
    wait_for(lambda: crashing.process.status == "exited", 30,
             "the beat to kill itself after a publish")
    assert marker.exists()
    unrecorded = p.rows(CLAIMED)
    assert len(unrecorded) > KILL_AT, f"a catch-up batch was cut short: {unrecorded}"
    assert p.redis.llen(p.queue) >= KILL_AT, "the published copies wait in the broker"

    crashing.restart()  # the kill point is disarmed: its file exists
    wait_for(lambda: not p.rows(CLAIMED), 30, "the restarted beat to re-send the batch")
    resent = [datetime.fromisoformat(s) for s in re.findall(
        r"beat: tick slot (\S+) was claimed by .* re-sent", crashing.process.logs())]
    assert sorted(to_seconds(to_us(s)) for s in resent) == sorted(unrecorded)

    worker.process.start()
    restarted = time.time()
    wait_for(lambda: any(s.timestamp() >= restarted + 2 * STEP for s in p.runs()), 40,
             "runs after the worker came back")
    crashing.kill("SIGKILL")
    wait_for(lambda: p.ran(p.rows(SENT, STARTED)), 30, "every published slot to run")

    runs = p.runs()
    twice = {s: n for s, n in Counter(runs).items() if n > 1}
    assert not twice, f"slots run more than once: {twice}"
    slots = sorted(runs)
    holes = [(a, b) for a, b in pairwise(slots) if (b - a).total_seconds() > STEP * 1.5]
    assert holes == [], f"slots lost: {holes}"
    assert set(map(to_seconds, map(to_us, slots))) >= set(unrecorded)
    for e in p.effects.entries():  # every send of a slot carried the slot's own task id
        assert e["task_id"] == task_id_for(p.key, to_us(datetime.fromisoformat(e["slot"])))

    logs = worker.process.all_logs()
    # Copies of the duplicates the crashing beat published, and of any slot whose body ended
    # in the instants before the worker's warm stop: its acknowledgement, made after the
    # stop closed the channel, is lost and kombu restores the message (it says so). Each
    # copy must be skipped, none run.
    restored = sum(int(n) for n in re.findall(r"Restoring (\d+) unacknowledged message", logs))
    copies = KILL_AT + restored
    if p.kind == "plain":
        skipped = re.findall(r"already started by \S+; \S+plain_tick\[(\S+)\] not run", logs)
        assert len(skipped) == copies, f"expected {copies} duplicate copies skipped: {logs}"
        assert set(p.rows(STARTED)) == set(map(to_seconds, map(to_us, slots)))
    else:
        skipped = re.findall(r"work beat:\S+ (?:already done|not run)", logs)
        assert len(skipped) == copies, f"expected {copies} duplicate copies skipped: {logs}"
        assert p.rows(STARTED) == [], "resumable tasks keep their claim, not a start record"
