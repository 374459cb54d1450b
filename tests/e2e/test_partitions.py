"""Real network partitions, library defaults (lease 30 s): a worker runs in a network
namespace of its own whose links to the store and to the broker are cut without a reset
(``celery_resilient.testing.partitions``), beside a worker on the host.

- **Store link cut** for longer than the lease, with a task that checkpoints every 20 rows
  and makes an effect outside the store every row: the cut worker stops that execution
  (self-fencing) before the other worker takes the work over, so the two never overlap; the
  work finishes once, its step once; the cut worker serves again once the link heals.
- **Broker link cut** for longer than the lease: the cut worker's running task finishes
  (the store is reachable); its prefetched resumable tasks are handed to the other worker
  within the lease; nothing runs twice; the cut worker consumes again once the link heals.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.partitions import NetworkNamespace
from celery_resilient.testing.services import StoreServer, ThrowawayRedis, throwaway_store

from .conftest import Project

STORE, BROKER = 0, 1
LEASE = 30.0  # the library's default
#: Network namespaces take a random 10.x subnet each: tests that make them run one at a time
#: (in one process of a parallel run), never two namespaces at once on one subnet.
pytestmark = pytest.mark.xdist_group("netns")


@dataclass
class World:
    ns: NetworkNamespace
    store: StoreServer
    redis: ThrowawayRedis
    project: Project

    def worker_inside(self, name: str, **kwargs: object) -> LocalWorker:
        env = {"RESILIENT_BROKER": self.redis.url_on(self.ns.host_ip(BROKER)),
               "RESILIENT_STORE_URL": self.store.url_on(self.ns.host_ip(STORE))}
        return self.project.worker(name=name, wrapper=self.ns.wrapper(), env=env, **kwargs)


@pytest.fixture(params=["postgresql"])
def world(request: pytest.FixtureRequest,
          make_project: Callable[..., Project]) -> Iterator[World]:
    """A network namespace whose links to a throwaway store server (of the kind the test
    asks for: PostgreSQL unless parametrised) and Redis can be cut."""
    ns = NetworkNamespace(2).create()
    store = throwaway_store(request.param, also_listen=[ns.host_ip(STORE)]).init()
    redis = ThrowawayRedis(also_listen=[ns.host_ip(BROKER)])
    try:
        store.start()
        redis.start()
        yield World(ns, store, redis, make_project(redis.url, store.url))
    finally:
        redis.destroy()
        store.destroy()
        ns.destroy()


def _epochs(effects: EffectLog, key: str) -> dict[int, list[float]]:
    spans: dict[int, list[float]] = {}
    for e in effects.entries():
        if e["effect"].startswith(("start:", "row:", "end:")) and key in e["effect"]:
            spans.setdefault(int(e["epoch"]), []).append(float(e["ts"]))
    return spans


def _assert_no_overlap(effects: EffectLog, key: str) -> float:
    """Executions (fencing tokens) of ``key`` follow each other; return the smallest gap."""
    spans = sorted(_epochs(effects, key).items())
    gaps = [min(later) - max(earlier)
            for (_, earlier), (_, later) in itertools.pairwise(spans)]
    assert all(g > 0 for g in gaps), f"executions of {key} overlapped: gaps {gaps}"
    return min(gaps) if gaps else float("inf")


@pytest.mark.parametrize("world", ["postgresql", "mariadb"], indirect=True)
def test_a_worker_cut_off_from_its_store_fences_itself_before_a_takeover(
        world: World, effect_log: EffectLog) -> None:
    """The store link cut without a reset for longer than the lease (30 s, the default), on
    each server store: the cut worker fences itself before another takes its work over, the
    executions never overlap, the step runs once, and the cut worker serves again after the
    heal."""
    project = world.project
    cut = world.worker_inside("cut", concurrency=1)
    key = project.send("sparse", 60, 0.5, 20)
    wait_for(lambda: effect_log.count(f"row:{key}:4") == 1, 60, "the cut worker to run it")
    other = project.worker(name="other", concurrency=1)
    cut_at = time.time()
    world.ns.cut(STORE)
    wait_for(lambda: "SELF-FENCING" in cut.process.logs(), 30, "the cut worker to fence")
    wait_for(lambda: len(_epochs(effect_log, key)) >= 2, LEASE + 30, "the other to take over")
    # the fault lasts longer than the lease
    wait_for(lambda: time.time() >= cut_at + LEASE + 5, LEASE + 10, "the cut to outlast")
    world.ns.heal(STORE)
    wait_for(lambda: project.state(key) == "done", 90, "the work to finish")
    gap = _assert_no_overlap(effect_log, key)
    assert effect_log.count(f"notify:{key}") == 1, "the step ran twice"
    assert effect_log.count(f"end:{key}") == 1
    print(f"store cut: the cut execution stopped {gap:.1f}s before the next one started")
    # the cut worker rejoins by itself: its lease renewed, its fence lifted, it serves again
    wait_for(lambda: "fence lifted" in cut.process.logs(), 60, "the cut worker to rejoin")
    other.process.stop()
    again = project.send("short", 7)
    wait_for(lambda: project.state(again) == "done", 60, "the cut worker to serve again")


def test_a_worker_cut_off_from_its_broker_hands_its_prefetched_work_to_others(
        world: World, effect_log: EffectLog) -> None:
    project = world.project
    cut = world.worker_inside("cut", concurrency=1)
    running = project.send("sparse", 40, 0.5, 5)
    waiting = [project.send("ingest", 3, 0.1) for _ in range(3)]
    wait_for(lambda: effect_log.count(f"row:{running}:1") == 1, 60, "the long task to run")
    wait_for(lambda: all(project.prefetched(k) for k in waiting), 30,
             "three tasks prefetched by the cut worker")
    other = project.worker(name="other", concurrency=1)
    cut_at = time.time()
    world.ns.cut(BROKER)
    wait_for(lambda: project.all_done(waiting), LEASE + 10,
             "the prefetched tasks to run elsewhere within the lease")
    handed_after = time.time() - cut_at
    wait_for(lambda: project.state(running) == "done", 60, "the running task to finish")
    wait_for(lambda: time.time() >= cut_at + LEASE + 10, LEASE + 20, "the cut to outlast")
    world.ns.heal(BROKER)
    for key in [running, *waiting]:
        assert effect_log.count(f"start:{key}") == 1, f"{key} ran twice"
    print(f"broker cut: prefetched work done elsewhere {handed_after:.1f}s after the cut")
    # the cut worker rejoins by itself: alone, it serves what comes next
    other.process.stop()
    again = [project.send("short", n) for n in range(6)]
    wait_for(lambda: project.all_done(again), 90, "the cut worker to serve again")
    assert cut.process.status == "running"
