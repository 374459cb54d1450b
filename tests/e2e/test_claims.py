"""Re-acquiring queue position: claimed work (running and prefetched) comes back in seconds.

Plain Celery measured on this machine: Redis returned nothing within 180 s of a SIGKILL,
kombu's SQLAlchemy transport lost the running and prefetched messages for good.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest
import redis

from celery_resilient.core import codec
from celery_resilient.core.states import TERMINAL_STATES
from celery_resilient.testing import EffectLog, WaitTimeout, wait_for
from celery_resilient.testing.services import ThrowawayRedis

from . import proj
from .conftest import Project

ROWS = 5
FAST = {"resilient_lease_seconds": 4, "resilient_heartbeat_interval": 1,
        "resilient_sweep_interval": 1}


@pytest.fixture(params=["redis", "rabbitmq", "sqlalchemy"])
def any_broker(request: pytest.FixtureRequest, redis_url: str, amqp_url: str,
               tmp_path: os.PathLike[str]) -> str:
    if request.param == "redis":
        return redis_url
    if request.param == "rabbitmq":
        return amqp_url
    return f"sqla+sqlite:///{tmp_path}/broker.sqlite3"


def _reserved_or_running(project: Project, keys: list[str]) -> bool:
    return all(project.state(k) in ("reserved", "running") for k in keys)


def _checkpointed(project: Project, key: str) -> int:
    found = project.store.load_checkpoint(key)
    return 0 if found is None else int(codec.decode(found[0])["row"])


def _assert_rows_once_but_inflight(effects: EffectLog, key: str, rows: int) -> None:
    counts = effects.counts()
    twice = [i for i in range(rows) if counts[f"row:{key}:{i}"] == 2]
    missing = [i for i in range(rows) if counts[f"row:{key}:{i}"] == 0]
    more = [i for i in range(rows) if counts[f"row:{key}:{i}"] > 2]
    assert not missing and not more, f"rows missing {missing} or repeated {more}"
    assert len(twice) <= 1, f"more than the in-flight row re-ran: {twice}"
    assert counts[f"notify:{key}"] == 1 and counts[f"charge:{key}"] == 1


def test_a_warm_shutdown_leaves_each_prefetched_message_once(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog) -> None:
    """SIGTERM to a worker holding prefetched work while another worker sweeps the same
    store: the broker gets each prefetched message back once (kombu's restore), and the
    sweeper does not publish a second copy of the claims handed back while the broker's
    own copies wait (they are held for ``resilient_submit_timeout``, its default here)."""
    project = make_project(redis_url)
    project.extra = {**FAST, "worker_prefetch_multiplier": 10, "resilient_submit_timeout": 60}
    worker = project.worker(concurrency=1)
    # the sweeping peer starts first: on a loaded machine its start took longer than the
    # long job's body, which then ended before the SIGTERM it is there to meet
    peer = project.nodes.worker("tests.e2e.proj", name="peer", queues=(f"{project.queue}-x",),
                                env={**project.env(), "RESILIENT_QUEUE": f"{project.queue}-x"})
    wait_for(lambda: " ready." in peer.process.logs(), 30, "the peer to run")
    long = project.send("ingest", 40, 0.1, task_id="job-long")
    waiting = [project.send("short", n, task_id=f"waiting-{n}") for n in range(6)]
    wait_for(lambda: _checkpointed(project, long) >= 2, 30, "the long job to checkpoint")
    wait_for(lambda: all(project.prefetched(k) for k in waiting), 30, "six jobs prefetched")
    worker.process.kill("SIGTERM", group=False)
    # what the assertions below count: the long job was still running at the SIGTERM
    assert _checkpointed(project, long) < 40 and not project.all_done([long])
    wait_for(lambda: worker.process.status == "exited", 60, "the worker to exit")
    queued = redis.Redis.from_url(redis_url)
    try:
        # the long job handed itself off (one copy), each waiting job came back once
        wait_for(lambda: queued.llen(project.queue) == len(waiting) + 1, 10,
                 "every held message back in the queue")
        try:  # five seconds of the peer's sweeps (one a second): no second copy appears
            grew = wait_for(lambda: queued.llen(project.queue) > len(waiting) + 1, 5,
                            "a second copy of a message")
        except WaitTimeout:
            grew = False
        assert not grew, f"{queued.llen(project.queue)} messages for {len(waiting) + 1}"
    finally:
        queued.close()
    worker.restart()
    wait_for(lambda: project.all_done([long, *waiting]), 60, "every job to finish")
    for key in waiting:
        assert effect_log.count(f"short:{key}") == 1, key


def test_restart_reacquires_running_and_prefetched(make_project: Callable[..., Project],
                                                   any_broker: str,
                                                   effect_log: EffectLog) -> None:
    project = make_project(any_broker)
    project.extra = {"worker_prefetch_multiplier": 5}  # one runs, four wait in prefetch
    worker = project.worker(concurrency=1)
    keys = [project.send("ingest", 30, 0.1, task_id="job-long")]
    keys += [project.send("ingest", ROWS, 0.05, task_id=f"job-{i}") for i in range(4)]
    wait_for(lambda: _checkpointed(project, keys[0]) >= 2, 30, "the first job to checkpoint")
    # kombu's SQL transport hands a worker one more message per poll, not four at once
    prefetched = keys[1:2] if any_broker.startswith("sqla") else keys[1:]
    wait_for(lambda: _reserved_or_running(project, prefetched), 30,
             f"{len(prefetched)} job(s) to be prefetched by the worker")
    worker.kill("SIGKILL")
    worker.restart()
    restarted = time.monotonic()
    wait_for(lambda: project.all_done(keys), 10, "all five jobs to finish within 10 s")
    broker = any_broker.split(":", maxsplit=1)[0]
    print(f"[{broker}] all 5 finished {time.monotonic() - restarted:.1f}s "
          "after the restarted worker was ready")
    _assert_rows_once_but_inflight(effect_log, keys[0], 30)
    assert effect_log.count(f"start:{keys[0]}") == 2
    for key in keys[1:]:  # prefetched, never started before the kill: each ran once
        assert effect_log.count(f"start:{key}") == 1
        _assert_rows_once_but_inflight(effect_log, key, ROWS)


# Alone: the second worker starts while the first still runs job-long (about 3 s left); on a
# busy machine a start took longer, job-long ended and the first started job-1 before its kill.
@pytest.mark.alone
def test_second_worker_takes_over_without_restart(make_project: Callable[..., Project],
                                                   any_broker: str,
                                                   effect_log: EffectLog) -> None:
    project = make_project(any_broker)
    project.extra = {**FAST, "worker_prefetch_multiplier": 5}
    first = project.worker(name="first", concurrency=1)
    keys = [project.send("ingest", 30, 0.1, task_id="job-long")]
    keys += [project.send("ingest", ROWS, 0.05, task_id=f"job-{i}") for i in range(4)]
    wait_for(lambda: _checkpointed(project, keys[0]) >= 2, 30, "the first job to checkpoint")
    prefetched = keys[1:2] if any_broker.startswith("sqla") else keys[1:]
    wait_for(lambda: _reserved_or_running(project, prefetched), 30, "jobs prefetched")
    project.worker(name="second", concurrency=1)
    first.kill("SIGKILL")  # never restarted
    killed = time.monotonic()
    # lease + one sweep, plus the work itself (~3 s) and a worker start's worth of slack
    budget = FAST["resilient_lease_seconds"] + FAST["resilient_sweep_interval"] + 3 + 5
    wait_for(lambda: project.all_done(keys), budget, "the second worker to finish all five")
    print(f"[{any_broker.split(':', maxsplit=1)[0]}] second worker finished all 5 "
          f"{time.monotonic() - killed:.1f}s after the kill")
    _assert_rows_once_but_inflight(effect_log, keys[0], 30)
    for key in keys[1:]:
        assert effect_log.count(f"start:{key}") == 1
        _assert_rows_once_but_inflight(effect_log, key, ROWS)


@pytest.mark.parametrize("reliable_fetch", [True, False], ids=["reliable-fetch", "kombu-fetch"])
def test_task_outliving_visibility_timeout_runs_once(make_project: Callable[..., Project],
                                                     redis_url: str, effect_log: EffectLog,
                                                     reliable_fetch: bool) -> None:
    """A task running past the visibility timeout: kombu's own fetch lets Redis deliver it
    again (the store skips that copy); the reliable fetch's holding keeps kombu's restore
    from delivering it at all while its worker lives."""
    project = make_project(redis_url)
    # Prefetch 1: the worker running it takes no other message, so a copy Redis delivers
    # goes to the other one, where the store's answer ("not run: running on") shows. With
    # more, a copy could land behind the original and be answered "already done" after it,
    # on a busy machine every time: the baseline then failed, the check below proved nothing.
    project.extra = {"resilient_reliable_fetch": reliable_fetch, "worker_prefetch_multiplier": 1,
                     "broker_transport_options": {"visibility_timeout": 2,
                                                  "unacked_restore_interval": 1,
                                                  "unacked_restore_throttle": 1}}
    workers = [project.worker(name="a"), project.worker(name="b")]
    key = project.send("sleeper", 8, task_id="long-one")
    wait_for(lambda: project.state(key) == "done", 40, "the long task to finish")
    assert effect_log.count(f"sleeper:{key}") == 1
    logs = "".join(w.process.logs() for w in workers)
    assert f"reliable_fetch={'on' if reliable_fetch else 'off'}" in logs
    if reliable_fetch:
        assert "not run: running on" not in logs, "Redis delivered a held message again"
    else:
        assert "not run: running on" in logs, "Redis never redelivered it: the test proved nothing"


def test_zombie_writes_are_refused(make_project: Callable[..., Project], redis_url: str,
                                   effect_log: EffectLog) -> None:
    """The last line of defence, with self-fencing off (the zombie would otherwise stop its
    execution as it wakes: test_a_woken_zombie_fences_itself): every write is refused."""
    project = make_project(redis_url)
    project.extra = {**FAST, "resilient_self_fencing": False}
    zombie = project.worker(name="zombie")
    key = project.send("fenced_probe", 60, 0.1, task_id="probe-1")
    wait_for(lambda: _checkpointed(project, key) >= 3, 30, "the probe to checkpoint")
    os.killpg(zombie.process.pid, signal.SIGSTOP)  # frozen mid-task: no heartbeats
    try:
        project.worker(name="rescuer")
        wait_for(lambda: project.state(key) == "done", 40, "the rescuer to finish the work")
    finally:
        os.killpg(zombie.process.pid, signal.SIGCONT)
    row = project.store.get_work(key)
    assert row is not None and row.epoch == 2
    assert codec.decode(row.result_json) == "by-epoch-2"
    wait_for(lambda: effect_log.count(f"refused:atomic:{key}") == 1, 30,
             "the zombie to try its remaining writes")
    counts = effect_log.counts()
    for kind in ("checkpoint", "step", "ledger", "atomic"):
        assert counts[f"refused:{kind}:{key}"] == 1, f"zombie {kind} write was not refused"
    for effect in (f"step:{key}", f"ledger:{key}", f"atomic:{key}", f"step:{key}:2",
                   f"ledger:{key}:2"):
        assert counts[effect] == 1, f"{effect} applied {counts[effect]} times"
    for effect in (f"step:{key}:1", f"ledger:{key}:1"):  # the zombie's own: never started
        assert counts[effect] == 0, f"zombie effect {effect} was applied"
    wait_for(lambda: "fenced" in zombie.process.logs(), 30, "the zombie's result to be refused")
    after = project.store.get_work(key)
    assert after is not None and codec.decode(after.result_json) == "by-epoch-2"


def test_a_woken_zombie_fences_itself(make_project: Callable[..., Project], redis_url: str,
                                      effect_log: EffectLog) -> None:
    """Frozen past its lease (SIGSTOP) while another worker took its work over: as it wakes,
    its worker stops the execution before it writes anything; nothing of it lands."""
    project = make_project(redis_url)
    project.extra = FAST
    zombie = project.worker(name="zombie")
    key = project.send("fenced_probe", 60, 0.1, task_id="probe-2")
    wait_for(lambda: _checkpointed(project, key) >= 3, 30, "the probe to checkpoint")
    os.killpg(zombie.process.pid, signal.SIGSTOP)
    try:
        project.worker(name="rescuer")
        wait_for(lambda: project.state(key) == "done", 40, "the rescuer to finish the work")
    finally:
        os.killpg(zombie.process.pid, signal.SIGCONT)
    wait_for(lambda: "fenced: stopped pool process" in zombie.process.logs(), 30,
             "the zombie to fence itself")
    row = project.store.get_work(key)
    assert row is not None and row.epoch == 2 and codec.decode(row.result_json) == "by-epoch-2"
    counts = effect_log.counts()
    for effect in (f"step:{key}", f"ledger:{key}", f"atomic:{key}"):
        assert counts[effect] == 1, f"{effect} applied {counts[effect]} times"
    for effect in (f"step:{key}:1", f"ledger:{key}:1"):
        assert counts[effect] == 0, f"zombie effect {effect} was applied"


def test_a_woken_zombie_runs_none_of_its_prefetched_work(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog) -> None:
    """Frozen past its lease (SIGSTOP) with work prefetched, the claims taken for it in its
    main process: another worker takes everything over and finishes it. Woken, the zombie
    must not run those bodies on the claims it had taken (their epochs are superseded)."""
    project = make_project(redis_url)
    project.extra = {**FAST, "worker_prefetch_multiplier": 10}
    zombie = project.worker(name="zombie", concurrency=1)
    long = project.send("ingest", 40, 0.1, task_id="zombie-long")
    waiting = [project.send("short", n, task_id=f"zombie-waiting-{n}") for n in range(5)]
    wait_for(lambda: _checkpointed(project, long) >= 2, 30, "the long job to checkpoint")
    wait_for(lambda: all(project.prefetched(k) for k in waiting), 30, "five jobs prefetched")
    os.killpg(zombie.process.pid, signal.SIGSTOP)
    try:
        project.worker(name="rescuer")
        wait_for(lambda: project.all_done([long, *waiting]), 60,
                 "the rescuer to finish everything")
    finally:
        os.killpg(zombie.process.pid, signal.SIGCONT)
    wait_for(lambda: "SELF-FENCING" in zombie.process.logs(), 30, "the zombie to fence")
    try:  # a window for the zombie's pool to take its prefetched requests
        ran = wait_for(lambda: any(effect_log.count(f"short:{k}") > 1 for k in waiting), 10,
                       "a prefetched body to run again")
    except WaitTimeout:
        ran = False
    assert not ran, {k: effect_log.count(f"short:{k}") for k in waiting}


def test_durable_submit_survives_broker_data_loss(make_project: Callable[..., Project],
                                                  effect_log: EffectLog) -> None:
    broker = "redis://127.0.0.1:6379/11"  # this test owns DB 11: it flushes it
    project = make_project(broker)
    project.extra = {"resilient_durable_submit": True, "resilient_submit_timeout": 3,
                     **FAST}
    client = proj.create_app({**project.env(), "RESILIENT_EFFECT_LOG": str(effect_log.path)})
    try:
        sender = client.tasks["tests.e2e.proj.short"]
        ids = [sender.apply_async((i,), task_id=f"submit-{i}").id for i in range(100)]
    finally:
        client.close()
    assert all(project.state(i) == "requeued" for i in ids)
    redis.Redis.from_url(broker).flushdb()  # the broker loses every message
    project.worker(concurrency=2)
    wait_for(lambda: project.all_done(ids), 60, "all 100 submitted tasks to finish")
    effect_log.assert_exactly_once({f"short:{i}" for i in ids})
    assert json.loads(json.dumps(effect_log.count(f"short:{ids[0]}"))) == 1


def test_a_broker_restart_strands_no_prefetched_work(make_project: Callable[..., Project],
                                                     effect_log: EffectLog) -> None:
    """Redis restarted (its data kept) while one job runs and four wait in prefetch. Celery
    forgets the prefetched deliveries when the connection drops (their delivery tags died
    with it) without acking or rejecting them, and Redis keeps them unacked for its
    visibility timeout, an hour. A worker that goes on (or is restarted by its supervisor
    when kombu's restore error makes it exit) must let their claims lapse so they are
    re-published within a lease or two: every job finishes, each once."""
    server = ThrowawayRedis(persistent=True).start()
    try:
        project = make_project(server.url)
        project.extra = {**FAST, "worker_prefetch_multiplier": 5}
        worker = project.worker(concurrency=1)
        keys = [project.send("ingest", 30, 0.1, task_id="job-long")]
        keys += [project.send("ingest", ROWS, 0.05, task_id=f"job-{i}") for i in range(4)]
        wait_for(lambda: _checkpointed(project, keys[0]) >= 2, 30, "the first job to checkpoint")
        wait_for(lambda: _reserved_or_running(project, keys[1:]), 30, "four jobs prefetched")
        server.kill()
        wait_for(lambda: "Connection to broker lost" in worker.process.logs()
                 or worker.process.status == "exited", 30, "the worker to lose the broker")
        server.start()
        if worker.process.status == "exited":  # kombu's restore error: a supervisor restarts it
            worker.restart()
        wait_for(lambda: project.all_done(keys), 60, "every job to finish within 60 s")
        for key in keys[1:]:
            assert effect_log.count(f"start:{key}") == 1, key
            _assert_rows_once_but_inflight(effect_log, key, ROWS)
        _assert_rows_once_but_inflight(effect_log, keys[0], 30)
    finally:
        server.destroy()


def test_a_hand_off_after_the_tasks_expires_passed_still_finishes_the_work(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog) -> None:
    """A task sent with ``expires`` that started in time, then met a warm shutdown after
    that time passed: its hand-off must finish the work on the other worker. Celery's
    ``expires`` bars a start, and plain Celery finishes such a task in its drain; a hand-off
    that kept ``expires`` had its copy discarded as expired, the work left ``expired`` half done."""
    project = make_project(redis_url)
    workers = [project.worker(name=name, concurrency=1) for name in ("first", "second")]
    key = project.send("ingest", 40, 0.1, task_id="job-expires", expires=2)
    wait_for(lambda: effect_log.count(f"start:{key}") == 1, 30, "the job to start")
    # either worker may have received it: stop the one whose pool process runs it
    pid = effect_log.entries(f"start:{key}")[0]["pid"]
    running = wait_for(lambda: next((w for w in workers if pid in w.process.children()), None),
                       10, f"the worker whose pool runs pid {pid}")
    # past its expires (2 s after it was sent) and well before its end (4 s of rows)
    wait_for(lambda: _checkpointed(project, key) >= 25, 30, "the job to run past its expires")
    running.process.kill("SIGTERM", group=False)
    wait_for(lambda: project.state(key) in TERMINAL_STATES, 60, "the job to end")
    assert project.state(key) == "done", project.store.get_work(key)
    assert effect_log.count(f"start:{key}") == 2, "the hand-off did not resume elsewhere"
    _assert_rows_once_but_inflight(effect_log, key, 40)
