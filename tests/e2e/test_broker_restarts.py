"""A broker restarted under running resumable work, then the worker SIGKILLed: nothing lost,
nothing applied twice, the worker consuming again after the broker came back.

Library defaults, one ``celery worker -c 2`` of ``tests/e2e/proj.py`` on PostgreSQL, a broker
of the test's own that keeps its data across the restart (Redis with an fsynced AOF, killed
with SIGKILL; RabbitMQ stopped and started, its durable queue kept). Four ``ingest`` units of
twelve checkpointed rows run two at a time; while two run, the broker goes away and comes
back. The worker must consume again (a task sent after the restart ends); two more units are
sent, and the worker is SIGKILLed while a unit runs, and restarted: every unit ends ``done``,
each row's effect once except the row in flight at an interruption, which may be seen twice
(its effect is outside the store), every resumed execution starts at its checkpoint, each
step and ledger effect once, and the broker holds nothing afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from celery_resilient.core import codec
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.rabbitmq_node import ThrowawayRabbitMQ
from celery_resilient.testing.services import ThrowawayRedis

from .conftest import Project

pytestmark = pytest.mark.e2e

UNITS, ROWS, DELAY = 4, 12, 0.4  # about 5 s a unit, two at a time


class Broker:
    """A broker of the test's own that keeps its data across a restart."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.redis = ThrowawayRedis(persistent=True) if kind == "redis" else None
        self.rabbit = None if self.redis else ThrowawayRabbitMQ(consumer_timeout=None)

    @property
    def url(self) -> str:
        return self.redis.url if self.redis else self.rabbit.url  # type: ignore[union-attr]

    def start(self) -> None:
        if self.redis:
            self.redis.start()
        else:
            self.rabbit.start()  # type: ignore[union-attr]

    def restart(self) -> None:
        if self.redis:
            self.redis.restart()  # SIGKILL, then a new server on the same files
        else:
            self.rabbit.stop()  # type: ignore[union-attr]
            self.rabbit.start()  # type: ignore[union-attr]

    def queued(self, queue: str) -> int:
        """Messages of ``queue`` still in the broker: ready, or delivered and unacknowledged."""
        if self.redis:
            client = redis.Redis.from_url(self.redis.url)
            return int(client.llen(queue)) + int(client.hlen("unacked"))
        return sum(self.rabbit.queue_counts(queue))  # type: ignore[union-attr]

    def destroy(self) -> None:
        if self.redis:
            self.redis.destroy()
        else:
            self.rabbit.destroy()  # type: ignore[union-attr]


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    made = Broker(request.param)
    try:
        made.start()
        yield made
    finally:
        made.destroy()


def _checkpointed(project: Project, key: str) -> int:
    found = project.store.load_checkpoint(key)
    return 0 if found is None else int(codec.decode(found[0])["row"])


def _running(project: Project, keys: list[str]) -> list[str]:
    return [k for k in keys if project.state(k) == "running" and 0 < _checkpointed(project, k)
            < ROWS - 2]


def _assert_each_effect_once(effects: EffectLog, key: str) -> list[int]:
    """Rows once, but the row each resumed execution started at (seen twice at most); every
    resume at a checkpoint taken before it; the step and the ledger effect once. Returns the
    rows the executions started at."""
    starts = [int(e["row"]) for e in effects.entries(f"start:{key}")]
    assert starts and starts[0] == 0, f"{key}: first execution started at {starts}"
    assert starts == sorted(starts), f"{key}: an execution went back: {starts}"
    counts = effects.counts()
    for i in range(ROWS):
        allowed = 2 if i in starts[1:] else 1
        assert 1 <= counts[f"row:{key}:{i}"] <= allowed, (
            f"{key}: row {i} ran {counts[f'row:{key}:{i}']} times (starts at {starts})")
    assert counts[f"notify:{key}"] == 1 and counts[f"charge:{key}"] == 1, key
    return starts


def test_a_broker_restart_then_a_worker_sigkill_loses_nothing_and_repeats_nothing(
        broker: Broker, make_project: Callable[..., Project], effect_log: EffectLog) -> None:
    project = make_project(broker.url)
    worker = project.worker(concurrency=2)
    keys = [project.send("ingest", ROWS, DELAY, task_id=f"{broker.kind}-unit-{i}")
            for i in range(UNITS)]
    wait_for(lambda: len(_running(project, keys)) >= 2, 60, "two units running, checkpointed")

    broker.restart()
    came_back = time.monotonic()
    probe = project.send("short", 1, task_id=f"{broker.kind}-after-restart")
    wait_for(lambda: project.state(probe) == "done", 60,
             "a task sent after the broker restart to end (the worker consumes again)")
    consumed_after = time.monotonic() - came_back

    # Units sent after the restart: what runs when the worker is killed (a slow restart lets
    # the first ones finish meanwhile, their acknowledgements on a new connection).
    keys += [project.send("ingest", ROWS, DELAY, task_id=f"{broker.kind}-later-{i}")
             for i in range(2)]
    victims = wait_for(lambda: _running(project, keys), 60, "a unit running to kill")
    saved = {k: _checkpointed(project, k) for k in victims}
    worker.kill("SIGKILL")
    worker.restart()
    wait_for(lambda: project.all_done(keys), 120, "every unit to end after the restart")

    resumed = {}
    for key in keys:
        starts = _assert_each_effect_once(effect_log, key)
        if key in victims:
            assert len(starts) >= 2 and starts[-1] >= saved[key], (
                f"{key} killed at checkpoint {saved[key]} resumed at {starts[1:]}")
            resumed[key] = starts[-1]
    assert effect_log.counts()[f"short:{probe}"] == 1
    wait_for(lambda: broker.queued(project.queue) == 0, 30, "nothing left in the broker")
    assert worker.process.status == "running"
    print(f"{broker.kind}: consumed again {consumed_after:.1f}s after the broker restart; "
          f"killed at {saved}, resumed at {resumed}")
