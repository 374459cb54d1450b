"""While the store is down, the backlog stays in the broker, not in the worker's memory.

A real ``celery worker`` runs on a throwaway PostgreSQL store that is stopped; 300 resumable
tasks are sent at once. The worker must pause consumption (its ConsumptionGate cancels the
task queue), hand back what it had already received (each take fails and re-sends its message
to the broker), and then hold nothing: every one of the 300 tasks waits in the broker queue,
and the countdown re-sends stop. Once PostgreSQL is back the worker resumes and every task
runs exactly once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.services import ThrowawayPostgres

from .conftest import Project

pytestmark = pytest.mark.e2e
TASKS = 300


def _redis_messages(broker_url: str, queue: str) -> list[dict[str, Any]]:
    """Every message waiting in the Redis list(s) of ``queue`` (priority lists included)."""
    client = redis.Redis.from_url(broker_url)
    try:
        keys = [queue] + [f"{queue}\x06\x16{p}" for p in range(1, 10)]
        return [json.loads(raw) for key in keys for raw in client.lrange(key, 0, -1)]
    finally:
        client.close()


def _ready_in_broker(broker_url: str, queue: str) -> int:
    """Messages of ``queue`` waiting in the broker, not delivered to any consumer."""
    if broker_url.startswith("redis"):
        return len(_redis_messages(broker_url, queue))
    with Connection(broker_url) as conn:
        ok = conn.default_channel.queue_declare(queue=queue, passive=True)
        return int(ok.message_count)


def _held_by_worker(project: Project, worker: LocalWorker) -> int | None:
    """Task messages the worker holds: running, prefetched, or waiting for their countdown."""
    inspect = project.client.control.inspect(destination=[worker.hostname()], timeout=2)
    held = 0
    for answer in (inspect.active(), inspect.reserved(), inspect.scheduled()):
        if not answer:
            return None  # no reply (yet)
        held += sum(len(v) for v in answer.values())
    return held


def _count(pattern: str, logs: str) -> int:
    return len(re.findall(pattern, logs))


RESENT = r"re-sent in"
FAILED_ROUND = r"maintenance round failed|lease renewal failed"


@pytest.mark.parametrize("broker_url", ["redis", "rabbitmq"], indirect=True)
def test_store_outage_pauses_consumption_and_keeps_the_backlog_in_the_broker(
        make_project: Callable[..., Project], broker_url: str,
        throwaway_pg: ThrowawayPostgres, effect_log: EffectLog) -> None:
    project = make_project(broker_url, throwaway_pg.url)
    project.extra = {"resilient_store_retry_base": 0.5, "resilient_store_retry_max": 2,
                     "resilient_heartbeat_interval": 1, "resilient_sweep_interval": 1}
    # A node name of its own: `inspect` must hear this worker only, and RabbitMQ's exclusive
    # pidbox queue must not collide with another test's worker@host.
    worker = project.worker(name=f"bp-{project.queue}", concurrency=2)
    logs: Callable[[], str] = worker.process.logs
    warm = project.send("short", -1)
    wait_for(lambda: project.all_done([warm]), 30, "a first task with the store up")

    throwaway_pg.stop_immediately()
    keys = [project.send("short", i) for i in range(TASKS)]  # no wait: races the detection
    wait_for(lambda: "paused consuming from" in logs(), 30,
             "the worker to pause consumption")
    # Every task waits in the broker, each exactly once (its original or its one re-send),
    # and the worker holds none: all it had received went back as re-sends.
    wait_for(lambda: (_ready_in_broker(broker_url, project.queue) == TASKS
                      and _held_by_worker(project, worker) == 0), 60,
             f"all {TASKS} messages back in the broker and none held by the worker")
    resent = _count(RESENT, logs())
    print(f"{resent} of {TASKS} tasks re-sent before the pause")
    assert resent < TASKS // 2, f"{resent} of {TASKS} tasks were consumed before the pause"
    if broker_url.startswith("redis"):
        queued = _redis_messages(broker_url, project.queue)
        assert sorted(m["headers"]["id"] for m in queued) == sorted(keys)
        countdown = sum(1 for m in queued if m["headers"].get("eta"))
        # each task re-sent is in the broker once, with its countdown; a re-sent copy that
        # came back before the pause (its countdown is 0.5 s) was re-sent again
        resent_ids = set(re.findall(r"; (\S+) re-sent in", logs()))
        assert countdown == len(resent_ids), (countdown, resent_ids, resent)

    # Paused, not busy: over several more failed maintenance rounds nothing is consumed, no
    # re-send is added, and the worker holds nothing.
    rounds = _count(FAILED_ROUND, logs())
    wait_for(lambda: _count(FAILED_ROUND, logs()) >= rounds + 3, 30,
             "three more failed maintenance rounds")
    assert _count(RESENT, logs()) == resent, "re-sends kept coming while paused"
    assert _ready_in_broker(broker_url, project.queue) == TASKS
    assert _held_by_worker(project, worker) == 0

    throwaway_pg.start()
    wait_for(lambda: "resumed consuming from" in logs(), 30, "the worker to resume")
    wait_for(lambda: project.all_done(keys), 120, f"all {TASKS} tasks to finish",
             interval=0.5)
    counts = effect_log.counts()
    ran = {key: counts[f"short:{key}"] for key in keys}
    assert set(ran.values()) == {1}, {k: n for k, n in ran.items() if n != 1}
    assert _ready_in_broker(broker_url, project.queue) == 0
    final = logs()
    assert _count(r"paused consuming from", final) == 1
    assert _count(r"resumed consuming from", final) == 1
    assert "Traceback" not in final, final[-4000:]

