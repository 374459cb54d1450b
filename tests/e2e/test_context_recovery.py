"""Continuity contexts under real workers: Redis flushed, restarted, stopped; SIGKILL mid-update;
two tasks racing on one context. The store (PostgreSQL) is the truth in every case."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_resilient.core import codec
from celery_resilient.store.contexts import ContextRows
from celery_resilient.testing import EffectLog, LocalWorker, wait_for
from celery_resilient.testing.services import ThrowawayRedis
from tests.integration.test_context_store import drop_namespace

from .conftest import Project

pytestmark = pytest.mark.e2e
APP = "tests.e2e.ctxproj"


class Session:
    """Drives ``ctxproj`` tasks for one context key and reads what the store holds."""

    def __init__(self, project: Project, effects: EffectLog) -> None:
        self.project = project
        self.effects = effects
        self.key = f"session-{uuid.uuid4().hex[:8]}"
        self.rows = ContextRows(project.store)

    def worker(self, **env: str) -> LocalWorker:
        return self.project.nodes.worker(APP, queues=(self.project.queue,),
                                         env={**self.project.env(), **env})

    def send(self, task: str, *args: Any) -> str:
        result = self.project.client.send_task(f"{APP}.{task}", args=(self.key, *args),
                                               queue=self.project.queue)
        return str(result.id)

    def run(self, task: str, *args: Any, timeout: float = 60) -> Any:
        task_id = self.send(task, *args)
        wait_for(lambda: self.project.state(task_id) == "done", timeout, f"{task} to finish")
        row = self.project.store.get_work(task_id)
        assert row is not None
        return codec.decode(row.result_json)

    def stored(self) -> tuple[int, dict[str, Any]]:
        row = self.rows.read(self.key)
        assert row is not None and row.data_json is not None
        return row.version, codec.decode(row.data_json)

    def seen(self, turn: str) -> list[dict[str, Any]]:
        return [e for e in self.effects.entries() if e["effect"] == f"seen:{turn}"]


def assert_whole(data: dict[str, Any]) -> None:
    """The payload was written by the same turn as the last one appended: never torn."""
    assert set(data["payload"].values()) == {data["turns"][-1]}, data
    assert len(data["payload"]) == 40


@pytest.fixture
def redis_project(make_project: Callable[..., Project], redis_url: str) -> Iterator[Project]:
    project = make_project(redis_url)
    yield project
    drop_namespace(redis_url, f"{project.prefix}ctx:")


@pytest.fixture
def cache_server(tmp_path: Path) -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis().start()
    yield server
    server.destroy()


def _recovered(worker: LocalWorker) -> bool:
    return "recovered from the store" in worker.process.logs()


def test_redis_flushed_between_two_tasks(redis_project: Project, effect_log: EffectLog,
                                         redis_url: str) -> None:
    """The default cache is the broker's Redis; losing all its keys loses nothing."""
    s = Session(redis_project, effect_log)
    worker = s.worker()
    assert s.run("open_session") == 1
    assert s.run("turn", "t1")["version"] == 2
    client = redis.Redis.from_url(redis_url)
    assert client.exists(f"{redis_project.prefix}ctx:{{{s.key}}}"), "the cache was not used"
    client.close()
    assert not _recovered(worker)
    assert drop_namespace(redis_url, f"{redis_project.prefix}ctx:") > 0
    assert s.run("turn", "t2") == {"version": 3, "turns": ["t0", "t1", "t2"]}
    [seen] = s.seen("t2")
    assert (seen["version"], seen["turns"], seen["payload"]) == (2, ["t0", "t1"], ["t1"])
    assert _recovered(worker)
    version, data = s.stored()
    assert version == 3 and data["turns"] == ["t0", "t1", "t2"]
    assert_whole(data)


def test_redis_restarted_between_two_tasks(make_project: Callable[..., Project],
                                           redis_url: str, cache_server: ThrowawayRedis,
                                           effect_log: EffectLog) -> None:
    project = make_project(redis_url)
    project.extra = {"resilient_context_cache_url": cache_server.url}
    s = Session(project, effect_log)
    worker = s.worker()
    s.run("open_session")
    s.run("turn", "t1")
    probe = redis.Redis(port=cache_server.port)
    assert probe.exists(f"{project.prefix}ctx:{{{s.key}}}"), "the cache was not used"
    probe.close()
    cache_server.restart()
    assert s.run("turn", "t2") == {"version": 3, "turns": ["t0", "t1", "t2"]}
    [seen] = s.seen("t2")
    assert (seen["version"], seen["turns"]) == (2, ["t0", "t1"])
    assert _recovered(worker)
    assert_whole(s.stored()[1])


def test_redis_stopped_tasks_keep_working_from_the_store(
        make_project: Callable[..., Project], redis_url: str, cache_server: ThrowawayRedis,
        effect_log: EffectLog) -> None:
    project = make_project(redis_url)
    project.extra = {"resilient_context_cache_url": cache_server.url}
    s = Session(project, effect_log)
    worker = s.worker()
    s.run("open_session")
    cache_server.stop()
    turns = ["t0"]
    for n in range(1, 6):
        turns.append(f"t{n}")
        assert s.run("turn", f"t{n}") == {"version": n + 1, "turns": turns}
        assert s.seen(f"t{n}")[0]["version"] == n
    assert "context cache unavailable" in worker.process.logs()
    version, data = s.stored()
    assert (version, data["turns"]) == (6, turns)
    assert_whole(data)


@pytest.mark.parametrize("point", ["in_update", "after_commit"])
def test_sigkill_mid_update_leaves_old_or_new_never_torn(project: Project, point: str,
                                                         effect_log: EffectLog) -> None:
    """Parametrised over Redis (Redis cache) and RabbitMQ (in-process cache) brokers."""
    s = Session(project, effect_log)
    worker = s.worker(RESILIENT_CTX_PAUSE=point)
    s.run("open_session")
    task_id = s.send("turn", "t1")
    wait_for(lambda: effect_log.count(f"paused:{point}") == 1, 60, f"the task to pause {point}")
    worker.kill("SIGKILL")
    version, data = s.stored()
    expected = {"in_update": (1, ["t0"]), "after_commit": (2, ["t0", "t1"])}[point]
    assert (version, data["turns"]) == expected
    assert_whole(data)

    worker.restart()
    wait_for(lambda: project.state(task_id) == "done", 90, "the retried turn to finish")
    retried = [e for e in s.seen("t1") if e["attempt"] > 1]
    assert retried, "the turn was not retried"
    assert (retried[-1]["version"], retried[-1]["turns"]) == expected, \
        "the retried task did not see what the store held"
    version, data = s.stored()
    assert (version, data["turns"]) == (2, ["t0", "t1"])
    assert_whole(data)


def test_concurrent_updates_one_conflicts_none_lost(redis_project: Project,
                                                    effect_log: EffectLog) -> None:
    s = Session(redis_project, effect_log)
    s.project.nodes.worker(APP, queues=(s.project.queue,), concurrency=2,
                           env=s.project.env())
    s.run("open_session")
    ids = [s.send("race", name, 2) for name in ("a", "b")]
    wait_for(lambda: s.project.all_done(ids), 90, "both racing tasks to finish")
    conflicts = [e for e in effect_log.entries() if e["effect"].startswith("conflict:")]
    assert len(conflicts) == 1, conflicts
    assert conflicts[0]["version"] == 1
    version, data = s.stored()
    assert version == 3
    assert sorted(data["turns"]) == ["a", "b", "t0"]
