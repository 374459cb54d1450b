"""Bad input that needs a real worker: a poison message, a store missing at startup, kill points.

Workers run ``tests/chaos/chaosproj.py`` (configured by environment) in their own process group.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from celery_resilient.store.sql import Store
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.plugin import NodeFactory
from celery_resilient.testing.services import drop_prefixed_tables

APP = "tests.chaos.chaosproj"


class Env:
    def __init__(self, nodes: NodeFactory, broker: str, store_url: str, prefix: str,
                 queue: str) -> None:
        self.nodes, self.broker, self.store_url = nodes, broker, store_url
        self.prefix, self.queue = prefix, queue
        self.store = Store(store_url, prefix)
        self.extra: dict[str, object] = {}
        self._client: Celery | None = None

    def env(self, **more: str) -> dict[str, str]:
        return {"CHAOS_BROKER": self.broker, "CHAOS_STORE_URL": self.store_url,
                "CHAOS_TABLE_PREFIX": self.prefix, "CHAOS_QUEUE": self.queue,
                "CHAOS_EXTRA": json.dumps(self.extra), **more}

    def worker(self, start: bool = True, concurrency: int = 1, **more: str) -> LocalWorker:
        return self.nodes.worker(APP, queues=(self.queue,), env=self.env(**more), start=start,
                                 concurrency=concurrency)

    def send(self, task: str, *args: object, task_id: str) -> str:
        if self._client is None:
            self._client = Celery("poison-client", broker=self.broker, set_as_current=False)
        self._client.send_task(f"chaos.{task}", args=args, task_id=task_id, queue=self.queue)
        return task_id

    def state(self, key: str) -> str | None:
        row = self.store.get_work(key)
        return None if row is None else row.state

    def close(self) -> None:
        self.store.dispose()
        if self._client is not None:
            self._client.close()


@pytest.fixture
def make_env(table_prefix: str, resilient_nodes: NodeFactory, pg_url: str, mysql_url: str,
             queue_name: str) -> Iterator[Callable[..., Env]]:
    """Envs on the machine's PostgreSQL, or on a store URL given; ``"mariadb"`` names the
    machine's MariaDB (its tables dropped afterwards)."""
    made: list[Env] = []

    def make(broker: str, store_url: str | None = None) -> Env:
        url = mysql_url if store_url == "mariadb" else store_url or pg_url
        env = Env(resilient_nodes, broker, url, table_prefix, queue_name)
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()
        if env.store_url == mysql_url:
            drop_prefixed_tables(mysql_url, table_prefix)


@pytest.mark.parametrize("store", ["postgresql", "mariadb"])
def test_poison_message_is_parked_dead_and_the_worker_survives(
        make_env: Callable[..., Env], redis_url: str, store: str,
        effect_log: EffectLog) -> None:
    env = make_env(redis_url, "mariadb" if store == "mariadb" else None)
    env.store.migrate()
    env.extra = {"resilient_max_attempts": 3}
    worker = env.worker()
    key = env.send("poison", task_id="poison-1")
    wait_for(lambda: env.state(key) == "dead", 90, "the poison message to be parked as dead")
    row = env.store.get_work(key)
    assert row is not None and row.deaths == 3
    assert row.error is not None and "resilient_max_attempts=3" in row.error
    runs = [e for e in effect_log.entries() if e["effect"] == "poison"]
    assert len(runs) == 3, f"ran {len(runs)} times, expected max_attempts=3: {runs}"
    assert sorted(e["epoch"] for e in runs) == [1, 2, 3]
    assert worker.process.status == "running", "the poison message took the worker down"
    wait_for(lambda: "is dead" in worker.process.logs(), 30, "the dead delivery to be refused")
    # The worker still works, and a fresh delivery of the dead work runs nothing.
    after = env.send("short", 21, 0.0, task_id="after-poison")
    env.send("poison", task_id="poison-1")
    wait_for(lambda: env.state(after) == "done", 30, "a normal task after the poison message")
    wait_for(lambda: worker.process.logs().count("is dead") >= 2, 30,
             "the second delivery of the dead work to be refused")
    assert len([e for e in effect_log.entries() if e["effect"] == "poison"]) == 3
    assert worker.process.status == "running"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("store", ["postgresql", "mariadb"])
def test_a_message_that_kills_its_whole_worker_is_parked_dead(
        make_env: Callable[..., Env], redis_url: str, store: str,
        effect_log: EffectLog) -> None:
    """A body that SIGKILLs its whole worker (main process included) 0.3 s in, every time:
    each death counts (the claim was marked started well before), and after
    ``resilient_max_attempts`` the work is parked instead of killing the worker for ever."""
    env = make_env(redis_url, "mariadb" if store == "mariadb" else None)
    env.store.migrate()
    env.extra = {"resilient_max_attempts": 3}
    worker = env.worker()
    key = env.send("poison_worker", 0.3, task_id="poison-worker-1")
    for death in range(3):
        wait_for(lambda: worker.process.status == "exited" or env.state(key) == "dead", 60,
                 f"death {death + 1} of the worker")
        if env.state(key) == "dead":
            break
        worker.restart()
    wait_for(lambda: env.state(key) == "dead", 60, "the work to be parked dead")
    row = env.store.get_work(key)
    assert row is not None and row.deaths == 3, row
    runs = [e for e in effect_log.entries() if e["effect"] == "poison_worker"]
    assert len(runs) == 3, f"ran {len(runs)} times, expected max_attempts=3: {runs}"
    assert worker.process.status == "running", "the parked message still killed the worker"


@pytest.mark.parametrize("problem", ["unreachable", "schema-missing", "bad-driver"])
def test_worker_with_a_bad_store_fails_at_startup_with_a_clear_error(
        make_env: Callable[..., Env], redis_url: str, pg_url: str, problem: str) -> None:
    urls = {"unreachable": f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/test",
            "schema-missing": pg_url,
            "bad-driver": "postgresql+nosuchdriver://127.0.0.1/test"}
    expected = {"unreachable": "store unreachable", "schema-missing": "schema (tables",
                "bad-driver": "names a database driver that is not installed"}
    env = make_env(redis_url, urls[problem])  # never migrated: its tables do not exist
    worker = env.worker(start=False)
    worker.process.start(wait=False)
    wait_for(lambda: worker.process.status == "exited", 60, "the worker to give up at startup")
    logs = worker.process.logs()
    assert expected[problem] in logs, logs[-3000:]
    assert " ready." not in logs, "the worker started consuming without its store"


def _killed_at_then_done(env: Env, tmp_path: Path, point: str, task: str, *args: object,
                         task_id: str) -> tuple[LocalWorker, str]:
    """A worker armed to kill itself at ``point`` (once), ``task`` sent to it; once the kill
    fired, the worker is restarted and the work waited for to end ``done``."""
    once = tmp_path / f"killed-{point.replace(':', '-')}"
    worker = env.worker(RESILIENT_KILL_AT=point, RESILIENT_KILL_ONCE=str(once))
    key = env.send(task, *args, task_id=task_id)
    wait_for(lambda: worker.process.status == "exited", 60, f"the {point} kill point to fire")
    assert once.read_text().startswith(point)
    worker.restart()
    wait_for(lambda: env.state(key) == "done", 60, "the work to finish after the restart")
    return worker, key


@pytest.mark.parametrize(("broker", "store"), [("redis", "postgresql"),
                                               ("rabbitmq", "postgresql"),
                                               ("redis", "mariadb")])
def test_kill_points_after_effect_and_before_ack(make_env: Callable[..., Env], broker: str,
                                                 store: str, redis_url: str, amqp_url: str,
                                                 tmp_path: Path, effect_log: EffectLog) -> None:
    """RESILIENT_KILL_AT: the whole worker dies right after a step's effect (before its marker),
    then right after a task's result commits (before the broker ack)."""
    env = make_env(redis_url if broker == "redis" else amqp_url,
                   "mariadb" if store == "mariadb" else None)
    env.store.migrate()
    worker, _ = _killed_at_then_done(env, tmp_path, "after_effect:2", "steps", 0.0,
                                     task_id="kp-steps")
    steps = [(e["step"], e["epoch"]) for e in effect_log.entries() if e["effect"] == "step"]
    # step a: once; step b: its effect ran, its marker did not commit: run again by epoch 2
    assert steps == [("a", 1), ("b", 1), ("b", 2), ("c", 2)], steps
    worker.kill("SIGKILL")

    acked = tmp_path / "killed-before-ack"
    worker = env.worker(RESILIENT_KILL_AT="before_ack", RESILIENT_KILL_ONCE=str(acked))
    short = env.send("short", 4, 0.0, task_id="kp-short")
    wait_for(lambda: worker.process.status == "exited", 60, "the before_ack kill point")
    assert env.state(short) == "done"
    worker.restart()
    if broker == "rabbitmq":  # RabbitMQ redelivers the unacked message at once
        wait_for(lambda: "already done" in worker.process.logs(), 30,
                 "the redelivered message to be answered from the store")
    shorts = [(e["key"], e["epoch"]) for e in effect_log.entries() if e["effect"] == "short"]
    assert shorts == [(short, 1)], f"the task before the ack kill ran again: {shorts}"


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_result_handed_over_and_lost_with_its_worker_runs_again_with_effects_once(
        make_env: Callable[..., Env], broker: str, redis_url: str, amqp_url: str,
        tmp_path: Path, effect_log: EffectLog) -> None:
    """The group commit's window (tasks/handed_results.py): a pool process handed its result to
    the main process, and the whole worker died before the main process committed it. The
    copy finds the claim open and runs the body again, as the relaxed ordering says: its
    steps' effects are not repeated (their markers were committed by the body), the work
    ends done once, and the ack of the copy's result waits for its own commit."""
    env = make_env(redis_url if broker == "redis" else amqp_url)
    env.store.migrate()
    _, key = _killed_at_then_done(env, tmp_path, "after_finish_handed", "steps", 0.0,
                                  task_id="handed-steps")
    starts = [e["epoch"] for e in effect_log.entries() if e["effect"] == "start"]
    steps = [(e["step"], e["epoch"]) for e in effect_log.entries() if e["effect"] == "step"]
    assert starts == [1, 2], f"the body ran again after the lost result: {starts}"
    assert steps == [("a", 1), ("b", 1), ("c", 1)], f"each step's effect once: {steps}"
    row = env.store.get_work(key)
    assert row is not None and (row.state, row.epoch) == ("done", 2)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_pool_process_killed_after_handing_its_result_over_runs_nothing_again(
        make_env: Callable[..., Env], broker: str, redis_url: str, amqp_url: str,
        tmp_path: Path, effect_log: EffectLog) -> None:
    """Only the pool process dies, after it handed its result over and before Celery heard
    of it (``RESILIENT_KILL_SCOPE=process``): the main process lives on and commits the
    result it holds, and the copy Celery requeues for the lost worker finds the work done.
    Nothing runs again, and the death is not counted against the work."""
    env = make_env(redis_url if broker == "redis" else amqp_url)
    env.store.migrate()
    once = tmp_path / "killed-pool-process"
    worker = env.worker(RESILIENT_KILL_AT="after_finish_handed", RESILIENT_KILL_SCOPE="process",
                        RESILIENT_KILL_ONCE=str(once))
    key = env.send("steps", 0.0, task_id="handed-then-child-killed")
    wait_for(once.exists, 60, "the pool process to die after its hand-over")
    wait_for(lambda: env.state(key) == "done", 30, "the handed result to be committed")
    wait_for(lambda: "already done" in worker.process.logs(), 30,
             "the requeued copy to be answered from the store")
    assert worker.process.status == "running", "the main process lives on"
    starts = [e["epoch"] for e in effect_log.entries() if e["effect"] == "start"]
    steps = [(e["step"], e["epoch"]) for e in effect_log.entries() if e["effect"] == "step"]
    assert starts == [1], f"the body ran again: {starts}"
    assert steps == [("a", 1), ("b", 1), ("c", 1)], steps
    row = env.store.get_work(key)
    assert row is not None and (row.state, row.epoch, row.deaths) == ("done", 1, 0), row


def test_a_duplicate_after_a_result_handed_over_is_not_run_again(
        make_env: Callable[..., Env], redis_url: str, effect_log: EffectLog) -> None:
    """Each task id delivered twice, back to back, no kill: the copy that a pool process
    takes after the first finished there, while the main process has not committed the
    result yet (the group commit), finds the work live here, not dead (a review ran 8 of
    300 bodies twice, each copy taking the claim over as a death)."""
    env = make_env(redis_url)
    env.store.migrate()
    env.extra = {"worker_prefetch_multiplier": 1}
    env.worker(concurrency=2)
    keys = []
    for n in range(500):
        key = f"dup-{n}"
        for _ in range(2):
            env.send("short", n, 0.0, task_id=key)
        keys.append(key)
        time.sleep(0.004)  # pacing, not waiting: a trickle leaves the pool idle between pairs
    wait_for(lambda: all(env.state(k) == "done" for k in keys), 120, "every task to finish")
    starts: dict[str, list[int]] = {}
    for e in effect_log.entries():
        if e["effect"] == "start":
            starts.setdefault(e["key"], []).append(e["epoch"])
    twice = {k: v for k, v in starts.items() if v != [1]}
    assert not twice, f"bodies run again: {twice}"
    assert sorted(starts) == sorted(keys)
    rows = [env.store.get_work(k) for k in keys]
    assert all(r is not None and (r.epoch, r.deaths) == (1, 0) for r in rows)


@pytest.mark.parametrize(("broker", "store"), [("redis", "postgresql"),
                                               ("rabbitmq", "postgresql"),
                                               ("redis", "mariadb")])
def test_kill_point_after_a_batch_of_takes(make_env: Callable[..., Env], broker: str,
                                           store: str, redis_url: str, amqp_url: str,
                                           tmp_path: Path, effect_log: EffectLog) -> None:
    """The whole worker dies once its main process committed a batch of takes and before
    the pool got any of those requests: the restarted worker runs each task once (Redis's
    holding given back, RabbitMQ's redelivery), and no death is counted for claims taken
    but never started. (MariaDB: the batch is one packet of statements, COMMIT included.)"""
    env = make_env(redis_url if broker == "redis" else amqp_url,
                   "mariadb" if store == "mariadb" else None)
    env.store.migrate()
    once = tmp_path / "killed-after-batch-take"
    worker = env.worker(RESILIENT_KILL_AT="after_batch_take", RESILIENT_KILL_ONCE=str(once))
    keys = [env.send("short", n, 0.0, task_id=f"bt-{n}") for n in range(6)]
    wait_for(lambda: worker.process.status == "exited", 60, "the kill point to fire")
    taken = [k for k in keys if env.state(k) == "running"]
    assert taken, "the batch committed no take before the kill"
    assert effect_log.entries() == [], "a request reached the pool before the kill"
    worker.restart()
    wait_for(lambda: all(env.state(k) == "done" for k in keys), 60,
             "every task to finish after the restart")
    starts = sorted(e["key"] for e in effect_log.entries() if e["effect"] == "start")
    assert starts == sorted(keys), f"each task once: {starts}"
    for key in taken:
        row = env.store.get_work(key)
        assert row is not None and (row.epoch, row.deaths) == (2, 0), row


@pytest.mark.parametrize("every", [0, -5])
def test_beat_with_a_non_positive_interval_fails_at_startup_naming_the_entry(
        resilient_nodes: NodeFactory, redis_url: str, pg_url: str, table_prefix: str,
        queue_name: str, effect_log: EffectLog, every: int) -> None:
    store = Store(pg_url, table_prefix)
    store.migrate()
    prefix = f"rb-bad-{table_prefix}:"
    beat = resilient_nodes.beat(
        "tests.e2e.beatproj", scheduler="celery_resilient.beat:ResilientScheduler", start=False,
        env={"RESILIENT_BROKER": redis_url, "RESILIENT_STORE_URL": pg_url,
             "RESILIENT_TABLE_PREFIX": table_prefix, "RESILIENT_QUEUE": queue_name,
             "RESILIENT_BEAT_PREFIX": prefix,
             "RESILIENT_BEAT_SCHEDULE": json.dumps({"ok": {"every": 1},
                                                    "broken": {"every": every}})})
    try:
        beat.process.start(wait=False)
        wait_for(lambda: beat.process.status == "exited", 60, "beat to refuse its schedule")
        logs = beat.process.logs()
        assert "beat entry 'broken'" in logs and "positive number of seconds" in logs, logs[-3000:]
        assert effect_log.entries() == []  # not even the valid entry was sent
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql(
                f"SELECT count(*) FROM {table_prefix}schedule_runs").scalar_one() == 0
    finally:
        store.dispose()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()
