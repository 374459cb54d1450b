"""Beat chaos: two beats contend for the same schedule and are SIGKILLed 20 times at random
points, several of them between a slot's claim and its publish. Every slot runs exactly once.

The beats run without RedBeat's lock, each on its own Redis view (split brain, as across a
partition or a failover), so nothing but the store's slot claims keeps them from sending a slot
twice. Killed beats come back at once or after a short pause; some come back armed with the
scheduler's claim kill point (``RESILIENT_BEAT_KILL_AFTER_CLAIM``), so they die right after
claiming a slot and before publishing it.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_resilient.beat.scheduler import KILL_AFTER_CLAIM_ENV
from celery_resilient.testing import EffectLog, LocalBeat, wait_for
from celery_resilient.testing.plugin import NodeFactory
from tests.e2e.test_beat_resilience import (
    BeatProject,
    assert_each_slot_once,
    assert_on_grid,
    gaps,
)

pytestmark = pytest.mark.chaos
KILLS = 20


@pytest.fixture(params=["postgresql", "mariadb"])
def beatproj(request: pytest.FixtureRequest, table_prefix: str, resilient_nodes: NodeFactory,
             redis_url: str, pg_url: str, mysql_url: str, queue_name: str,
             effect_log: EffectLog) -> Iterator[BeatProject]:
    """The beats' slot claims in the machine's PostgreSQL or MariaDB."""
    store_url = mysql_url if request.param == "mariadb" else pg_url
    project = BeatProject(resilient_nodes, redis_url, store_url, table_prefix, queue_name,
                          effect_log)
    yield project
    project.close()


def _pause(seconds: float) -> None:
    """The chaos clock: let the beats work (or stay down) for a while."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, seconds + 1, f"{seconds:.1f}s to pass")


def _forget_view(url: str, prefix: str) -> None:
    other = redis.Redis.from_url(url)
    keys = list(other.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        other.delete(*keys)
    other.close()


@pytest.mark.timeout(300)
def test_two_beats_killed_twenty_times_send_every_slot_once(beatproj: BeatProject,
                                                            tmp_path: Path) -> None:
    rng = random.Random()
    seed = rng.randrange(1_000_000)
    rng.seed(seed)
    print(f"beat chaos seed {seed}")
    beatproj.extra = {"redbeat_lock_key": None}
    views = [beatproj.redis_url, re.sub(r"/\d+$", "/10", beatproj.redis_url)]
    beatproj.worker()
    armed = 0

    def start(view: int, arm: bool = False) -> LocalBeat:
        nonlocal armed
        env = {"RESILIENT_BEAT_REDIS": views[view]}
        if arm or rng.random() < 0.35:  # die right after the next slot claim, before the publish
            armed += 1
            env[KILL_AFTER_CLAIM_ENV] = str(tmp_path / f"claim-kill-{armed}")
        node = beatproj.beat(start=False, **env)
        node.process.start(wait=False)
        return node

    # The first beat always dies between a claim and its publish (the window this test is
    # for): a random kill could come before a slow start's first claim, every time.
    beats = [start(0, arm=True), start(1)]
    wait_for(lambda: any(tmp_path.glob("claim-kill-*")), 60,
             "the first beat to die between a claim and its publish")
    kills = 0
    try:
        while kills < KILLS:
            i = rng.randrange(2)
            _pause(rng.uniform(0.5, 2.5))
            beats[i].kill("SIGKILL")  # also reaps a beat that killed itself after a claim
            kills += 1
            if rng.random() < 0.3:  # down for a moment: slots to catch up
                _pause(rng.uniform(1, 3))
            beats[i] = start(i)
        for b in beats:
            b.kill("SIGKILL")
        # A clean beat re-sends anything claimed and never published, and catches up.
        final = beatproj.beat(RESILIENT_BEAT_REDIS=views[0])
        ended = time.time()
        wait_for(lambda: beatproj.ran_through(ended + 3 * beatproj.step), 60,
                 "runs after the chaos")
        # Every slot the dead beats claimed is re-sent and recorded, while the clean beat
        # runs: killing it in turn may leave its own latest slot claimed (published or not,
        # as any crash between a claim and its record does; the next beat re-sends it).
        through = ended + 3 * beatproj.step
        wait_for(lambda: not [r for r in beatproj.slots.runs_of(beatproj.key())
                              if r.state == "claimed" and r.slot <= through], 30,
                 "the clean beat to record every slot claimed before it as sent")
        final.kill("SIGKILL")
        rows = beatproj.slots.runs_of(beatproj.key())
        sent = {round(r.slot, 3) for r in rows if r.state == "sent"}
        wait_for(lambda: sent <= {round(s.timestamp(), 3) for s in beatproj.runs()}, 60,
                 "every sent slot to run")
    finally:
        _forget_view(views[1], beatproj.prefix)

    fired = len(list(tmp_path.glob("claim-kill-*")))
    slots = assert_each_slot_once(beatproj)
    assert gaps(slots, beatproj.step) == [], f"slots never run: {gaps(slots, beatproj.step)}"
    assert_on_grid(slots, beatproj.step)
    left = [r for r in beatproj.slots.runs_of(beatproj.key()) if r.state == "claimed"]
    assert len(left) <= 1 and all(r.slot > through for r in left), (
        f"claimed slots left other than the clean beat's latest: {left}")
    assert slots[-1].timestamp() - slots[0].timestamp() >= 20, "the run was too short"
    assert fired >= 1, "no beat was killed between a claim and its publish"
    print(f"{kills} kills ({fired} between claim and publish), {len(slots)} slots, "
          "each exactly once")
