"""Deploys and faults on real workers: warm-shutdown hand-off, one node name on two live
workers, and a store outage longer than the lease.

Every execution of the long task records its start, each step and its end with its pid and
fencing token (tests/e2e/deployproj.py), so each test checks what a user would: the work
finished once, each step ran once, and no two executions of one unit overlapped in time.
"""

from __future__ import annotations

import collections
import itertools
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection
from sqlalchemy import select

from celery_resilient.core import messages
from celery_resilient.core.identity import Owner
from celery_resilient.core.states import DONE, EXPIRED, REVOKED, TERMINAL_STATES
from celery_resilient.testing import EffectLog, WaitTimeout, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.services import ThrowawayPostgres, ThrowawayRedis

from .conftest import Project
from .lifecycleproj import result_backend_for

pytestmark = pytest.mark.e2e
APP = "tests.e2e.deployproj"
TASK = "tests.e2e.deployproj.long_job"


def _worker(project: Project, name: str, node: str | None = None,
            **settings: Any) -> LocalWorker:
    """A worker of deployproj; ``settings`` override the project's extra app.conf."""
    args = ["-n", node] if node else []
    env = project.env()
    env["RESILIENT_EXTRA"] = json.dumps({**project.extra, **settings})
    return project.nodes.worker(APP, name=name, queues=(project.queue,), env=env,
                                extra_args=args)


def _client(project: Project) -> Celery:
    app = Celery("deploy-client", broker=project.broker,
                 backend=result_backend_for(project.env()), set_as_current=False)
    app.conf.task_default_queue = project.queue
    return app


def _send(client: Celery, steps: int, delay: float) -> str:
    return str(client.send_task(TASK, args=(steps, delay)).id)


def _executions(effects: EffectLog, key: str) -> list[list[dict[str, Any]]]:
    """The entries of each execution of ``key`` (one per fencing token), in start order."""
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for e in effects.entries():
        if e.get("key") == key:
            by_epoch.setdefault(int(e["epoch"]), []).append(e)
    return [by_epoch[k] for k in sorted(by_epoch)]


def _assert_no_overlap(effects: EffectLog, key: str) -> list[list[dict[str, Any]]]:
    runs = _executions(effects, key)
    for earlier, later in itertools.pairwise(runs):
        assert earlier[-1]["ts"] <= later[0]["ts"], (
            f"executions of {key} overlap: epoch {earlier[0]['epoch']} (pid "
            f"{earlier[0]['pid']}) wrote at {earlier[-1]['ts']:.3f}, after epoch "
            f"{later[0]['epoch']} (pid {later[0]['pid']}) started at {later[0]['ts']:.3f}")
    return runs


def _steps(effects: EffectLog, key: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for e in effects.entries("step"):
        if e["key"] == key:
            counts[e["i"]] = counts.get(e["i"], 0) + 1
    return counts


def _running_on(effects: EffectLog, key: str, *workers: LocalWorker) -> LocalWorker:
    pid = _executions(effects, key)[-1][0]["pid"]
    return wait_for(lambda: next((w for w in workers if pid in w.process.children()), None),
                    10, f"the worker whose pool runs pid {pid}")


def _stopped_within(worker: LocalWorker, seconds: float) -> float:
    started = time.monotonic()
    worker.process.kill("SIGTERM", group=False)  # what a deploy or Kubernetes sends
    wait_for(lambda: worker.process.status == "exited", seconds,
             f"{worker.worker_name} to exit within {seconds:.0f}s of SIGTERM")
    return time.monotonic() - started


@pytest.mark.parametrize("broker_url", ["redis", "rabbitmq"], indirect=True)
def test_sigterm_hands_running_work_to_another_worker(make_project: Callable[..., Project],
                                                      broker_url: str,
                                                      effect_log: EffectLog) -> None:
    """Two workers, a 24 s task checkpointing every 0.1 s, SIGTERM to the one running it:
    it must exit within 10 s, which only a hand-off allows (its task has 23 s to go)."""
    project = make_project(broker_url)
    first, second = _worker(project, "w1"), _worker(project, "w2")
    client = _client(project)
    steps, delay = 240, 0.1
    key = _send(client, steps, delay)
    wait_for(lambda: sum(_steps(effect_log, key).values()) >= 8, 60, "8 steps")
    stopping = _running_on(effect_log, key, first, second)
    staying = second if stopping is first else first

    took = _stopped_within(stopping, 10)
    wait_for(lambda: len(_executions(effect_log, key)) >= 2, 10,
             "the other worker to resume the work")
    assert client.AsyncResult(key).get(timeout=120) == {"steps": steps}

    runs = _assert_no_overlap(effect_log, key)
    assert len(runs) == 2, [r[0] for r in runs]
    handed_at = runs[1][0]["at"]
    assert handed_at >= 8, f"the second execution started at step {handed_at}, not the checkpoint"
    assert runs[1][0]["ts"] - runs[0][-1]["ts"] < 5, "the hand-off took more than a few seconds"
    assert runs[1][0]["pid"] in staying.process.children()
    assert _steps(effect_log, key) == {i: 1 for i in range(steps)}, "a step ran twice or never"
    row = project.store.get_work(key)
    assert row is not None and (row.state, row.deaths, row.attempts) == ("done", 0, 2)
    assert f"handed off work {key}" in stopping.process.all_logs()
    print(f"stopping worker exited {took:.1f}s after SIGTERM; resumed at step {handed_at}")


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_sigterm_to_a_lone_worker_then_restart_resumes(make_project: Callable[..., Project],
                                                       broker_url: str,
                                                       effect_log: EffectLog) -> None:
    project = make_project(broker_url)
    worker = _worker(project, "lone")
    client = _client(project)
    steps, delay = 120, 0.25
    key = _send(client, steps, delay)
    wait_for(lambda: sum(_steps(effect_log, key).values()) >= 8, 60, "8 steps")
    _stopped_within(worker, 10)
    row = project.store.get_work(key)
    assert row is not None and row.state == "requeued", row  # handed back, not running

    worker.restart()
    assert client.AsyncResult(key).get(timeout=120) == {"steps": steps}
    runs = _assert_no_overlap(effect_log, key)
    assert len(runs) == 2 and runs[1][0]["at"] >= 8
    assert _steps(effect_log, key) == {i: 1 for i in range(steps)}
    row = project.store.get_work(key)
    assert row is not None and (row.state, row.deaths) == ("done", 0)


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_two_live_workers_with_one_node_name_never_take_each_others_work(
        make_project: Callable[..., Project], broker_url: str, effect_log: EffectLog) -> None:
    """`celery worker -n same@%h` twice (two workers on one host without -n, host-network
    containers): each sweeps every 0.5 s, and neither may take the other's live claims."""
    project = make_project(broker_url)
    project.extra = {"resilient_sweep_interval": 0.5, "resilient_heartbeat_interval": 1,
                     "resilient_lease_seconds": 6}
    first = _worker(project, "same-1", node="same@%h")
    second = _worker(project, "same-2", node="same@%h")
    client = _client(project)
    steps, delay = 60, 0.25  # 15 s each: 30 sweeps per worker, 2.5 leases
    keys = [_send(client, steps, delay) for _ in range(2)]
    for key in keys:
        assert client.AsyncResult(key).get(timeout=120) == {"steps": steps}
    for key in keys:
        runs = _assert_no_overlap(effect_log, key)
        assert len(runs) == 1, f"{key} started {len(runs)} times"
        assert _steps(effect_log, key) == {i: 1 for i in range(steps)}
        row = project.store.get_work(key)
        assert row is not None and (row.state, row.deaths, row.republished) == ("done", 0, 0)
    logs = first.process.all_logs() + second.process.all_logs()
    assert "ANOTHER LIVE WORKER USES THE NODE NAME" in logs


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_store_outage_longer_than_the_lease_takes_no_live_claim(
        make_project: Callable[..., Project], broker_url: str,
        throwaway_pg: ThrowawayPostgres, effect_log: EffectLog) -> None:
    """PostgreSQL stopped for twice the lease while tasks run on two workers, then started:
    no sweep takes a claim its owner still holds (every owner gets a lease of grace).

    Worker "a" sweeps every 0.5 s; worker "b" renews its lease at most every 1.5 s while the
    store is down, so "a" reaches the store first and sees "b"'s lease long expired."""
    project = make_project(broker_url, throwaway_pg.url)
    # Self-fencing off: this proves the sweeps' grace after an outage on its own (with it
    # on, each owner would stop its executions first, as the outage outlasts the lease).
    project.extra = {"resilient_sweep_interval": 0.5, "resilient_heartbeat_interval": 1,
                     "resilient_lease_seconds": 6, "resilient_store_retry_base": 0.5,
                     "resilient_store_retry_max": 1, "resilient_self_fencing": False}
    workers = [_worker(project, "a"), _worker(project, "b", resilient_heartbeat_interval=3)]
    client = _client(project)
    steps, delay = 60, 0.25
    keys = [_send(client, steps, delay) for _ in range(2)]
    wait_for(lambda: all(sum(_steps(effect_log, k).values()) >= 4 for k in keys), 60,
             "both tasks running")
    throwaway_pg.stop_immediately()
    wait_for(lambda: all("maintenance round failed" in w.process.logs() for w in workers), 30,
             "both workers to see the outage")
    down_since = time.monotonic()
    wait_for(lambda: time.monotonic() - down_since > 12, 30, "an outage of twice the lease")
    throwaway_pg.start()
    for key in keys:
        assert client.AsyncResult(key).get(timeout=180) == {"steps": steps}
    for key in keys:
        runs = _assert_no_overlap(effect_log, key)
        counts = _steps(effect_log, key)
        assert set(counts) == set(range(steps)), f"{key}: steps missing"
        # A step cut by the outage (its checkpoint not saved) is done again by the copy
        # that resumes: at most one step per resumed execution, nothing else.
        again = [i for i, n in counts.items() if n > 1]
        assert all(counts[i] == 2 for i in again) and len(again) <= len(runs) - 1, counts
        row = project.store.get_work(key)
        assert row is not None and row.state == "done"
    # Checkpoint progress resets the counters: the logs are the witness. A claim taken from
    # its owner is re-published "was running/reserved"; one whose execution re-sent itself
    # is let go to requeued, and may be re-published as such (an extra copy that finds it
    # taken runs nothing; the non-overlap and the step counts above prove it).
    for w in workers:
        taken = [line for line in w.process.all_logs().splitlines()
                 if "released:" in line or re.search(
                     r"re-published orphaned work \S+ \(was (running|reserved)", line)]
        assert not taken, f"{w.worker_name} took or released live claims: {taken}"


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_claim_running_nowhere_on_a_live_worker_is_let_go_and_runs(
        make_project: Callable[..., Project], broker_url: str, effect_log: EffectLog) -> None:
    """A take that committed but whose execution never started (its reply was lost, or the
    store and the broker were both down at a re-send): the live worker's incarnation holds a
    running claim that nothing executes. The worker lets it go and the work runs, once."""
    project = make_project(broker_url)
    project.extra = {"resilient_sweep_interval": 0.5}
    client = _client(project)
    key = _send(client, 4, 0.05)
    with Connection(project.broker) as conn:  # the real message, off the queue
        raw = wait_for(lambda: conn.default_channel.basic_get(project.queue), 10, "the message")
        message = messages.from_kombu(raw)
        raw.ack()
    worker = _worker(project, "alive")
    wk = project.store.t.workers
    with project.store.engine.connect() as db:
        incarnation = db.execute(select(wk.c.incarnation).where(
            wk.c.node == worker.hostname(), wk.c.stopped_at.is_(None))).scalar_one()
        db.rollback()
    pool_pid = worker.pool_pids()[0]
    holder = Owner(worker.hostname(), incarnation, pool_pid)
    project.store.record_receipt(key, TASK, key, None, message, holder, 30)
    taken = project.store.take(key, TASK, key, None, holder, 30, 5, lambda *_: True)
    assert taken.action == "run"  # ... and then nothing runs it

    assert client.AsyncResult(key).get(timeout=60) == {"steps": 4}
    runs = _assert_no_overlap(effect_log, key)
    assert len(runs) == 1 and runs[0][0]["at"] == 0
    row = project.store.get_work(key)
    assert row is not None and (row.state, row.deaths) == ("done", 0)
    assert f"work {key} requeued: its execution ended without an outcome" in (
        worker.process.all_logs())


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_revoked_running_work_drains_at_a_deploy_as_in_celery(
        make_project: Callable[..., Project], broker_url: str, effect_log: EffectLog) -> None:
    """revoke() without terminate lets running work finish (Celery); a deploy must not turn
    that into a hand-off whose copy is discarded as revoked, half done (found by review)."""
    project = make_project(broker_url)
    first, second = _worker(project, "r1"), _worker(project, "r2")
    client = _client(project)
    steps = 40
    key = _send(client, steps, 0.25)
    wait_for(lambda: sum(_steps(effect_log, key).values()) >= 4, 60, "4 steps")
    stopping = _running_on(effect_log, key, first, second)
    client.control.revoke(key)
    wait_for(lambda: project.store.is_revoked(key), 10, "the revoke copied into the store")
    stopping.process.kill("SIGTERM", group=False)
    assert client.AsyncResult(key).get(timeout=60) == {"steps": steps}
    wait_for(lambda: stopping.process.status == "exited", 30, "the drained worker to exit")
    runs = _assert_no_overlap(effect_log, key)
    assert len(runs) == 1, "the revoked work was handed off instead of drained"
    assert _steps(effect_log, key) == {i: 1 for i in range(steps)}



@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_sigterm_as_the_store_stops_exits_promptly(
        make_project: Callable[..., Project], broker_url: str,
        throwaway_pg: ThrowawayPostgres, effect_log: EffectLog) -> None:
    """A deploy's SIGTERM in the first moments of a PostgreSQL outage (chaos seeds 249079,
    812969): hand-offs and checkpoints fail, the tasks re-send themselves or are rejected
    back to the broker as the warm shutdown begins, and the shutdown step cannot record the
    drain. Each time the worker must exit promptly (it hung at exit, its pool never joined),
    and every unit must finish once when the store is back, with no overlapping executions."""
    project = make_project(broker_url, throwaway_pg.url)
    project.extra = {"resilient_lease_seconds": 6, "resilient_heartbeat_interval": 1,
                     "resilient_store_retry_base": 0.5, "resilient_store_retry_max": 1}
    client = _client(project)
    steps = 300
    keys: list[str] = []
    moments: list[tuple[str, Callable[[LocalWorker], object]]] = [
        ("while PostgreSQL stops", lambda w: None),
        ("once it is down", lambda w: not throwaway_pg.running()),
        ("as the tasks re-send themselves", lambda w: "re-sent in" in w.process.logs()),
        ("once consumption is paused", lambda w: "paused consuming" in w.process.logs()),
    ]
    for n, (moment, ready) in enumerate(moments):
        worker = project.nodes.worker(APP, name=f"r{n}", queues=(project.queue,),
                                      env=project.env(), concurrency=2)
        pair = [_send(client, steps, 0.01) for _ in range(2)]
        keys += pair
        wait_for(lambda pair=pair: all(sum(_steps(effect_log, k).values()) >= 2 for k in pair),
                 60, "both tasks running")
        stopper = threading.Thread(target=throwaway_pg.stop_immediately)
        stopper.start()
        wait_for(lambda w=worker, ready=ready: ready(w) is not False, 30, moment)
        worker.process.kill("SIGTERM", group=False)
        stopper.join()
        wait_for(lambda w=worker: w.process.status == "exited", 20,
                 f"the worker to exit within 20 s of a SIGTERM {moment}")
        logs = worker.process.all_logs()
        assert "warm shutdown: " in logs, f"the shutdown step did not run to its end {moment}"
        throwaway_pg.start()
    _worker(project, "finisher")
    for key in keys:
        assert client.AsyncResult(key).get(timeout=180) == {"steps": steps}
        runs = _assert_no_overlap(effect_log, key)
        counts = _steps(effect_log, key)
        assert set(counts) == set(range(steps)), f"{key}: steps missing"
        again = [i for i, c in counts.items() if c > 1]  # cut before its checkpoint landed
        assert all(counts[i] == 2 for i in again) and len(again) <= len(runs) - 1, counts


def _sigterms_into_a_stream(worker: LocalWorker, send_five: Callable[[], None],
                            effect_log: EffectLog, cycles: int) -> list[float]:
    """``cycles`` deploys of ``worker`` while a thread calls ``send_five`` every 20 ms: each
    SIGTERM once 200 more bodies ran, each restart at once. Returns the seconds from each
    SIGTERM to the worker's exit, having asserted each was prompt (about 2 s here; the
    pool's 30 s wait, or a hang, is the fault)."""
    sending = threading.Event()

    def stream() -> None:
        while sending.is_set():
            send_five()
            time.sleep(0.02)

    exits: list[float] = []
    for cycle in range(cycles):
        sending.set()
        sender = threading.Thread(target=stream)
        sender.start()
        try:
            before = len(effect_log.entries())
            wait_for(lambda before=before: len(effect_log.entries()) >= before + 200, 60,
                     f"cycle {cycle}: the worker to run 200 more bodies of the stream")
            started = time.monotonic()
            worker.process.kill("SIGTERM", group=False)
            wait_for(lambda: worker.process.status == "exited", 60,
                     f"cycle {cycle}: the worker to exit")
            exits.append(time.monotonic() - started)
        finally:
            sending.clear()
            sender.join()
        worker.process.start()
    print(f"exits after SIGTERM: {', '.join(f'{s:.1f}s' for s in exits)}")
    assert max(exits) < 20, f"a warm shutdown waited for its pool: {exits}"
    return exits


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_sigterms_into_a_stream_of_tasks_exit_promptly_and_run_each_body_once(
        make_project: Callable[..., Project], broker_url: str, effect_log: EffectLog) -> None:
    """Deploys into a steady stream of short tasks (Redis defaults). Celery's warm shutdown
    drops the jobs it has written to a pool process that did not yet say it received them
    (worker/pool_drain.py): with plain Celery 5.7, such a job's pool process then waited 30 s
    to exit, in about 2 of 8 of these SIGTERMs, and its message ran again after the restart;
    and it drops the rest of a message it was writing in parts (one in ten here is larger
    than a pipe's buffer), so the pool process waits for it for ever and the worker never
    exits (a review: 5 of 6 SIGTERMs with plain Celery).
    Each SIGTERM here must end the worker as promptly as the others (a 30 s wait is that
    hang), and every task must end ``done`` with its body run once. With no result backend
    the stream takes the group commit (tasks/handed_results.py): results handed over as the
    shutdown begins must end with their claims, not be handed back (without that, 6 bodies
    of this test ran twice)."""
    project = make_project(broker_url)
    worker = project.worker(concurrency=2)
    keys: list[str] = []

    def send_five() -> None:  # about 250 a second, within what two pool processes run
        for _ in range(5):
            # one in ten larger than a pipe's buffer: the pool writes it in parts
            big = len(keys) % 10 == 0
            keys.append(project.send("short", len(keys), "x" * 300_000 if big else ""))

    _sigterms_into_a_stream(worker, send_five, effect_log, cycles=8)
    wait_for(lambda: project.all_done(keys), 120, f"all {len(keys)} tasks to finish")
    counts = effect_log.counts()
    twice = [k for k in keys if counts[f"short:{k}"] != 1]
    assert not twice, f"{len(twice)} bodies ran other than once, e.g. {twice[:3]}"


def _ended_otherwise_than_once(project: Project, kinds: dict[str, str],
                               counts: collections.Counter[str]) -> list[str]:
    """Tasks of the outcome stream whose stored end and bodies run do not agree."""
    wrong: list[str] = []
    for key, kind in kinds.items():
        state = project.state(key)
        if kind == "retried":
            runs = [counts[f"retried:{key}:{n}"] for n in (0, 1)]
            ok = state == DONE and runs == [1, 1]
        else:
            runs = [counts[f"short:{key}"]]
            allowed = {"short": {DONE}, "expires": {DONE, EXPIRED, None},
                       "revoked": {DONE, REVOKED, None}}[kind]
            ok = state in allowed and runs == [1 if state == DONE else 0]
        if not ok:
            wrong.append(f"{kind} {key}: {state}, bodies {runs}")
    return wrong


def test_sigterms_into_a_stream_of_revokes_expiries_and_retries_end_each_task_once(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog) -> None:
    """The deploys above, with Celery's other outcomes in the stream (Redis defaults): one
    task in seven expires 0.5, 2 or 5 s after it is sent, one in eleven is revoked at once, one in
    thirteen retries once. A deploy lands while each kind waits in prefetch, in the pool's
    pipe, or in its countdown. Every task must end, and end once: a body that ran is
    ``done`` (a retried one ran each of its two tries once), one that did not is
    ``revoked`` or ``expired``, or has no row at all where Celery discarded its message
    before any claim (docs/guarantees.md); a revoke broadcast while the worker was down is
    lost, as on plain Celery, and that task runs. No body runs twice, and nothing is left
    in the queue or held unacknowledged."""
    project = make_project(redis_url)
    worker = project.worker(concurrency=2)
    kinds: dict[str, str] = {}

    def send_five() -> None:
        revoke: list[str] = []
        for _ in range(5):
            n = len(kinds)
            if n % 13 == 7:
                kinds[project.send("retried", n)] = "retried"
            elif n % 7 == 3:
                expires = (0.5, 2.0, 5.0)[n // 7 % 3]  # before, at and after the receipt
                kinds[project.send("short", n, expires=expires)] = "expires"
            else:
                key = project.send("short", n)
                kinds[key] = "revoked" if n % 11 == 5 else "short"
                if n % 11 == 5:
                    revoke.append(key)
        if revoke:
            project.client.control.revoke(revoke)

    _sigterms_into_a_stream(worker, send_five, effect_log, cycles=5)
    keys = list(kinds)
    queued = redis.Redis.from_url(redis_url)

    def consumed() -> bool:  # nothing left in the queue or held unacknowledged for it
        unacked = [json.loads(entry)[2] for entry in queued.hvals("unacked")]
        return queued.llen(project.queue) == 0 and project.queue not in unacked

    def ended(key: str) -> bool:  # Celery discards a revoked or expired message unclaimed
        state = project.state(key)
        return state in TERMINAL_STATES or (state is None and kinds[key] != "short")

    try:
        wait_for(lambda: consumed() and all(ended(k) for k in keys), 120,
                 f"all {len(keys)} tasks to end")
    except WaitTimeout:
        stuck = [(kinds[k], k, project.state(k)) for k in keys if not ended(k)]
        by_kind = collections.Counter((kind, state) for kind, _, state in stuck)
        pytest.fail(f"{len(stuck)} of {len(keys)} tasks did not end ({dict(by_kind)}; "
                    f"consumed: {consumed()}), e.g. {stuck[:4]}")
    finally:
        queued.close()
    wrong = _ended_otherwise_than_once(project, kinds, effect_log.counts())
    stopped = {kind: collections.Counter(project.state(k) for k, v in kinds.items()
                                         if v == kind and project.state(k) != DONE)
               for kind in ("expires", "revoked")}
    print(f"{len(keys)} tasks; not run, by state: {stopped}")
    assert not wrong, f"{len(wrong)} tasks ended wrong, e.g. {wrong[:5]}"
    # what the stream is there for: some revokes and expiries did stop their task
    assert stopped["expires"] and stopped["revoked"], stopped


def test_a_deploy_while_the_broker_is_down_exits_cleanly_not_declared_dead(
        make_project: Callable[..., Project]) -> None:
    """SIGTERM while the broker is down: the worker records its stop, then waits for the
    broker to forget its holding. Its lease heartbeat must not read its own stop as another
    worker declaring it dead (SELF-FENCING, exit 1) meanwhile: a deploy that met a broker
    outage exits as any deploy does."""
    server = ThrowawayRedis().start()
    try:
        project = make_project(server.url)
        worker = _worker(project, "w1", resilient_lease_seconds=6,
                         resilient_heartbeat_interval=1)
        worker.process.ready()
        server.kill()
        wait_for(lambda: "Connection to broker lost" in worker.process.logs(), 30,
                 "the worker to lose the broker")
        worker.process.kill("SIGTERM", group=False)
        wait_for(lambda: worker.process.status == "exited", 90, "the worker to exit")
        logs = worker.process.logs()
        assert "declared dead" not in logs and "SELF-FENCING" not in logs, logs[-3000:]
        assert worker.process.proc is not None and worker.process.proc.returncode == 0, \
            logs[-3000:]
    finally:
        server.destroy()
