"""Every Celery outcome ends the work exactly once, on real ``celery worker`` processes.

One test per outcome. Each checks three things: the caller's ``AsyncResult`` state (as plain
Celery 5.7 shows it), the store's work state, and how many times the task body ran. After the
terminal state is reached, an observation window longer than several re-publish and sweep
intervals (``resilient_submit_timeout=2``, ``resilient_sweep_interval=0.5``) must see none of
the three change while the worker's maintainer keeps running: an endless re-publish loop, a
re-run or a late state change would show.

Workers run ``tests/e2e/lifecycleproj.py`` with a Redis result backend.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select

from celery_resilient.core import codec, messages
from celery_resilient.testing import EffectLog, WaitTimeout, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.services import ThrowawayPostgres

from . import lifecycleproj
from .conftest import Project, close_result_client

APP = lifecycleproj.NAME
FAST = {"resilient_submit_timeout": 2, "resilient_sweep_interval": 0.5,
        "resilient_heartbeat_interval": 0.5, "resilient_lease_seconds": 3}
#: How long a terminal outcome must stay put: 5 re-publish timeouts, 20 sweep intervals.
WINDOW = 10.0
#: Deadline for an outcome to be reached.
SETTLE = 60.0


class Lab:
    """Workers of ``lifecycleproj``, a client with the result backend, the store and effects."""

    def __init__(self, project: Project, effects: EffectLog, backend: str) -> None:
        self.project = project
        self.store = project.store
        self.effects = effects
        self.env = {**project.env(), "RESILIENT_RESULT_BACKEND": backend}
        self.client = lifecycleproj.create_app(self.env)

    def worker(self, concurrency: int = 1, name: str = "lifecycle") -> LocalWorker:
        return self.project.nodes.worker(APP, name=name, concurrency=concurrency,
                                         queues=(self.project.queue,), env=self.env)

    def send(self, task: str, *args: Any, **options: Any) -> str:
        task_id = f"{task}-{uuid.uuid4().hex[:12]}"  # the result backend is shared
        self.client.send_task(f"{APP}.{task}", args=args, task_id=task_id,
                              queue=self.project.queue, **options)
        return task_id

    # -- the three witnesses ----------------------------------------------------------------

    def work_state(self, task_id: str) -> str | None:
        row = self.store.get_work(task_id)
        return None if row is None else row.state

    def meta(self, task_id: str) -> dict[str, Any]:
        """The caller's view, read afresh (AsyncResult caches ready states)."""
        meta: dict[str, Any] = self.client.backend.get_task_meta(task_id, cache=False)
        return meta

    def async_state(self, task_id: str) -> str:
        return str(self.meta(task_id)["status"])

    def runs(self, task_id: str) -> int:
        return self.effects.count(f"run:{task_id}")

    def run_entries(self, task_id: str) -> list[dict[str, Any]]:
        return self.effects.entries(f"run:{task_id}")

    # -- waits ------------------------------------------------------------------------------

    def describe(self, task_id: str) -> str:
        row = self.store.get_work(task_id)
        where = ("no row" if row is None else
                 f"state={row.state} epoch={row.epoch} deaths={row.deaths} "
                 f"republished={row.republished} error={row.error!r}")
        return f"{task_id}: store {where}; caller {self.async_state(task_id)}; " \
               f"runs {self.runs(task_id)}"

    def settle(self, task_id: str, worker: LocalWorker, work_state: str,
               async_state: str, timeout: float = SETTLE) -> None:
        """Wait (with a deadline) for the store and the caller to show the outcome."""
        try:
            wait_for(lambda: self.work_state(task_id) == work_state
                     and self.async_state(task_id) == async_state, timeout,
                     f"store {work_state} and caller {async_state}", interval=0.1)
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}\nnow: {self.describe(task_id)}\n"
                                 f"worker log:\n{worker.process.all_logs()[-6000:]}") from None

    def settle_key(self, work_key: str, task_id: str, worker: LocalWorker, work_state: str,
                   async_state: str, timeout: float = SETTLE) -> None:
        """``settle`` for work whose key is not its task id (derive_work_key)."""
        def state() -> str | None:
            row = self.store.get_work(work_key)
            return None if row is None else row.state

        try:
            wait_for(lambda: state() == work_state and self.async_state(task_id) == async_state,
                     timeout, f"{work_key} {work_state} and caller {async_state}", interval=0.1)
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}\nnow: {work_key} {state()}, caller "
                                 f"{self.async_state(task_id)}\n"
                                 f"worker log:\n{worker.process.all_logs()[-6000:]}") from None

    def last_heartbeat(self, worker: LocalWorker) -> float | None:
        wk = self.store.t.workers
        with self.store.engine.connect() as conn:
            value = conn.execute(select(func.max(wk.c.heartbeat_at))
                                 .where(wk.c.node == worker.hostname())).scalar_one_or_none()
            conn.rollback()
        return None if value is None else float(value)

    def holds(self, task_id: str, worker: LocalWorker, work_state: str, async_state: str,
              runs: int, window: float = WINDOW) -> None:
        """Over ``window`` seconds nothing about the ended work changes, while the worker's
        maintainer (heartbeat and sweep share one loop) keeps running."""
        row = self.store.get_work(task_id)
        assert row is not None, f"{task_id} has no work row"
        epoch = row.epoch
        started = self.store.now()

        def violation() -> str:
            now = self.store.get_work(task_id)
            problems = []
            if now is None or now.state != work_state or now.epoch != epoch:
                problems.append(f"store {now and now.state} epoch {now and now.epoch} "
                                f"(expected {work_state} at epoch {epoch})")
            if self.async_state(task_id) != async_state:
                problems.append(f"caller {self.async_state(task_id)} (expected {async_state})")
            if self.runs(task_id) != runs:
                problems.append(f"body ran {self.runs(task_id)} times (expected {runs})")
            if worker.process.status != "running":
                problems.append("the worker exited")
            return "; ".join(problems)

        try:
            found = wait_for(violation, window, "the ended work to change", interval=0.2)
        except WaitTimeout:
            found = ""
        assert not found, (f"{task_id} changed after it ended: {found}\n"
                           f"worker log:\n{worker.process.all_logs()[-6000:]}")
        beat = self.last_heartbeat(worker)
        assert beat is not None and beat >= started + window - 1.5, (
            f"the maintainer stalled during the window: last heartbeat {beat}, "
            f"window started at {started}")
        logs = worker.process.all_logs()
        assert "maintenance round failed" not in logs, logs[-6000:]

    def verify(self, task_id: str, worker: LocalWorker, work_state: str, async_state: str,
               runs: int) -> dict[str, Any]:
        """Settle, check the run count, observe the window; the caller's meta for more checks."""
        self.settle(task_id, worker, work_state, async_state)
        assert self.runs(task_id) == runs, self.describe(task_id)
        self.holds(task_id, worker, work_state, async_state, runs)
        return self.meta(task_id)

    def republish_stored(self, task_id: str) -> None:
        """Send the stored message again, byte for byte: a copy delivered late."""
        message = self.store.get_message(task_id)
        assert message is not None, f"{task_id} has no stored message"
        with self.client.connection_for_write() as conn:
            messages.publish(conn, message, {}, self.client)

    def close(self) -> None:
        close_result_client(self.client)


@pytest.fixture
def make_lab(make_project: Callable[..., Project], redis_url: str, amqp_url: str,
             effect_log: EffectLog) -> Iterator[Callable[..., Lab]]:
    made: list[Lab] = []

    def make(broker: str = "redis", **extra: Any) -> Lab:
        project = make_project(redis_url if broker == "redis" else amqp_url)
        project.extra = {**FAST, **extra}
        lab = Lab(project, effect_log, redis_url)
        made.append(lab)
        return lab

    yield make
    for lab in made:
        lab.close()


def _error(meta: dict[str, Any]) -> str:
    return type(meta["result"]).__name__


def _refusals(worker: LocalWorker, task_id: str) -> int:
    return worker.process.all_logs().count(f"not run: request {task_id} was revoked")


BROKERS = pytest.mark.parametrize("broker", ["redis", "rabbitmq"])


# -- the body's own outcomes ----------------------------------------------------------------


@BROKERS
def test_success(make_lab: Callable[..., Lab], broker: str) -> None:
    lab = make_lab(broker)
    worker = lab.worker()
    task_id = lab.send("succeed", 21)
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=1)
    assert meta["result"] == 42
    row = lab.store.get_work(task_id)
    assert row is not None and codec.decode(row.result_json) == 42 and row.deaths == 0


def test_exception(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("boom")
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "ValueError" and str(meta["result"]) == "boom"
    row = lab.store.get_work(task_id)
    assert row is not None and row.error == "ValueError: boom"


def test_retry_within_max_retries_resumes_from_checkpoint(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("retry_then_ok")
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=2)
    assert meta["result"] == {"tries": 1, "retries": 1}
    runs = lab.run_entries(task_id)
    assert [r["seen"] for r in runs] == [0, 1], "the retry did not resume from its checkpoint"
    assert [r["retries"] for r in runs] == [0, 1]
    assert [r["epoch"] for r in runs] == [1, 2]
    row = lab.store.get_work(task_id)
    assert row is not None and row.deaths == 0, "a retry was counted as a death"


@BROKERS
def test_retry_past_max_retries_fails_with_the_original_exception(
        make_lab: Callable[..., Lab], broker: str) -> None:
    lab = make_lab(broker)
    worker = lab.worker()
    task_id = lab.send("retry_always")
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=2)  # max_retries=1
    assert _error(meta) == "ValueError" and "still failing after 1" in str(meta["result"])
    row = lab.store.get_work(task_id)
    assert row is not None and row.deaths == 0 and row.epoch == 2
    assert row.error is not None and row.error.startswith("ValueError")


def test_autoretry_for_with_retry_backoff(make_lab: Callable[..., Lab]) -> None:
    """Two failures, two automatic retries 1 s apart, then success (exhaustion: retry_always)."""
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("autoretry", 2)
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=3)  # max_retries=2
    assert meta["result"] == 2
    times = [r["ts"] for r in lab.run_entries(task_id)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0.9 for g in gaps), f"retry_backoff (1 s) not respected: {gaps}"
    row = lab.store.get_work(task_id)
    assert row is not None and row.deaths == 0 and row.epoch == 3


def test_retry_with_arguments_of_another_work_key_runs_once(
        make_lab: Callable[..., Lab]) -> None:
    """The old key must not be left requeued and re-published for ever, each copy running the
    body again: it ends ``ignored`` and the retry runs once."""
    lab = make_lab()
    worker = lab.worker()
    label = f"L-{uuid.uuid4().hex[:8]}"
    task_id = lab.send("retry_new_args", label)
    lab.settle_key(f"label:{label}-v2", task_id, worker, "done", "SUCCESS")
    assert lab.meta(task_id)["result"] == f"{label}-v2"
    assert [r["key"] for r in lab.run_entries(task_id)] == [f"label:{label}",
                                                           f"label:{label}-v2"]

    def violation() -> str:
        old, new = lab.store.get_work(f"label:{label}"), lab.store.get_work(f"label:{label}-v2")
        problems = []
        if old is None or old.state != "ignored":
            problems.append(f"old key {old and old.state}")
        if new is None or new.state != "done":
            problems.append(f"new key {new and new.state}")
        if lab.runs(task_id) != 2:
            problems.append(f"body ran {lab.runs(task_id)} times")
        return "; ".join(problems)

    try:
        found = wait_for(violation, WINDOW, "the retried work to change", interval=0.2)
    except WaitTimeout:
        found = ""
    assert not found, f"{found}\n{worker.process.all_logs()[-6000:]}"
    old = lab.store.get_work(f"label:{label}")
    assert old is not None and "retried as work" in (old.error or "")


def test_replace_runs_the_replacement_under_the_task_id(make_lab: Callable[..., Lab]) -> None:
    """The replacement is not refused (WorkKeyConflict)."""
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("replacer", 21)
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=2)  # replacer, then succeed
    assert meta["result"] == 42
    assert [r["task"] for r in lab.run_entries(task_id)] == ["replacer", "succeed"]
    row = lab.store.get_work(task_id)
    assert row is not None and (row.epoch, row.deaths) == (2, 0), lab.describe(task_id)


def test_a_late_copy_of_done_work_sends_no_chain_step_again(
        make_lab: Callable[..., Lab]) -> None:
    """A redelivered copy of done work must not "succeed" again, or Celery sends the next
    chain step a second time."""
    from celery import chain

    lab = make_lab()
    worker = lab.worker()
    first, second = (f"succeed-{uuid.uuid4().hex[:12]}" for _ in range(2))
    q = lab.project.queue
    chain(lab.client.signature(f"{APP}.succeed", args=(1,), task_id=first, queue=q),
          lab.client.signature(f"{APP}.succeed", args=(), task_id=second, queue=q)
          ).apply_async()
    lab.settle(second, worker, "done", "SUCCESS")
    assert lab.meta(second)["result"] == 4  # (1 * 2) * 2
    lab.republish_stored(first)  # a late copy of the first step, its chain included
    wait_for(lambda: "already done and reported" in worker.process.all_logs(), SETTLE,
             "the late copy to be acknowledged without a second success")
    lab.holds(second, worker, "done", "SUCCESS", runs=1)
    assert lab.runs(first) == 1


def test_ignore(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("ignored")
    lab.verify(task_id, worker, "ignored", "PENDING", runs=1)  # Celery stores no state


def test_reject_with_requeue_runs_again_and_succeeds(make_lab: Callable[..., Lab],
                                                     tmp_path: Path) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("reject_requeue", str(tmp_path / "rejected-once"))
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=2)
    assert meta["result"] == "second delivery"
    assert [r["first"] for r in lab.run_entries(task_id)] == [True, False]
    row = lab.store.get_work(task_id)
    assert row is not None and row.deaths == 0 and row.epoch == 2


def test_reject_without_requeue_fails(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("reject_drop")
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "Reject"
    row = lab.store.get_work(task_id)
    assert row is not None and row.error is not None and row.error.startswith("Reject")


# -- revoke and expires -----------------------------------------------------------------------


def _busy_with_sleeper(lab: Lab, gate: Path, seconds: float = 60) -> str:
    """A concurrency-1 worker's only process runs a sleeper until ``gate`` exists."""
    sleeper = lab.send("sleeper", seconds, str(gate))
    wait_for(lambda: lab.work_state(sleeper) == "running" and lab.runs(sleeper) == 1, 30,
             "the sleeper to run")
    return sleeper


def test_revoke_prefetched_never_runs(make_lab: Callable[..., Lab], tmp_path: Path) -> None:
    lab = make_lab()
    worker = lab.worker()
    gate = tmp_path / "gate"
    sleeper = _busy_with_sleeper(lab, gate)
    task_id = lab.send("succeed", 1)
    wait_for(lambda: lab.project.prefetched(task_id), 30, "the task to be prefetched")
    lab.client.control.revoke(task_id)
    wait_for(lambda: lab.store.is_revoked(task_id), 10,
             "the revoke to reach the store while the task is still prefetched")
    gate.touch()  # the process is free: Celery discards the revoked request
    wait_for(lambda: f"Discarding revoked task: {APP}.succeed[{task_id}]"
             in worker.process.logs(), 30, "Celery to discard the revoked request")
    lab.verify(task_id, worker, "revoked", "REVOKED", runs=0)
    assert lab.work_state(sleeper) == "done"


def test_a_revoked_prefetched_request_leaves_its_work_key_to_the_next(
        make_lab: Callable[..., Lab], tmp_path: Path) -> None:
    """Pairs of requests for one logical work key each (``derive_work_key``, the same call
    twice) wait behind a busy process, and the first of each pair is revoked: Celery
    discards it, and the second runs, as on plain Celery (whichever starts first runs; a
    revoked one never starts). Ten pairs, since each is a race between the discard and the
    second request's take."""
    pairs = 10
    lab = make_lab(worker_prefetch_multiplier=2 * pairs + 5)
    worker = lab.worker()
    gate = tmp_path / "gate"
    sleeper = _busy_with_sleeper(lab, gate)
    labels = [f"order-{uuid.uuid4().hex[:8]}" for _ in range(pairs)]
    sent = [(lab.send("labelled", label, 7), lab.send("labelled", label, 7))
            for label in labels]
    wait_for(lambda: all(f"labelled[{second}] received" in worker.process.logs()
                         for _, second in sent), 30, "every request to be prefetched")
    lab.client.control.revoke([first for first, _ in sent])
    wait_for(lambda: all(lab.store.is_revoked(first) for first, _ in sent), 10,
             "the revokes to reach the store")
    gate.touch()
    for label, (first, second) in zip(labels, sent, strict=True):
        lab.settle_key(f"label:{label}", second, worker, "done", "SUCCESS")
        assert lab.meta(second)["result"] == 7
        assert (lab.runs(first), lab.runs(second)) == (0, 1), label
        assert lab.async_state(first) == "REVOKED"
    assert lab.work_state(sleeper) == "done"


@BROKERS
def test_revoke_prefetched_then_sigkill_and_restart_never_runs(
        make_lab: Callable[..., Lab], broker: str, tmp_path: Path) -> None:
    lab = make_lab(broker)
    worker = lab.worker()
    gate = tmp_path / "gate"
    sleeper = _busy_with_sleeper(lab, gate)
    task_id = lab.send("succeed", 1)
    wait_for(lambda: lab.project.prefetched(task_id), 30, "the task to be prefetched")
    lab.client.control.revoke(task_id)
    wait_for(lambda: lab.store.is_revoked(task_id), 10, "the revoke to reach the store")
    worker.kill("SIGKILL")  # the revoke list in the worker's memory is gone
    gate.touch()  # the re-run sleeper ends at once
    worker.restart()  # no mingle: the new worker never heard of the revoke
    if broker == "rabbitmq":  # RabbitMQ redelivers the unacked prefetched message at once
        wait_for(lambda: _refusals(worker, task_id) >= 1, 30,
                 "the redelivered revoked message to be refused")
    before = _refusals(worker, task_id)
    lab.republish_stored(task_id)  # a copy delivered late (Redis: after its visibility timeout)
    wait_for(lambda: _refusals(worker, task_id) > before, 30,
             "the late copy of the revoked message to be refused")
    lab.verify(task_id, worker, "revoked", "REVOKED", runs=0)
    wait_for(lambda: lab.work_state(sleeper) == "done", 30, "the sleeper to be resumed")


def test_revoke_terminate_running_task(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("sleeper", 60)
    wait_for(lambda: lab.work_state(task_id) == "running" and lab.runs(task_id) == 1, 30,
             "the sleeper to run")
    lab.client.control.revoke(task_id, terminate=True)
    lab.verify(task_id, worker, "revoked", "REVOKED", runs=1)
    assert f"Terminating {task_id}" in worker.process.logs()
    # The worker still serves (its pool replaced the terminated process).
    after = lab.send("succeed", 2)
    lab.settle(after, worker, "done", "SUCCESS")


@pytest.mark.parametrize("backlog", [1, 20])
def test_expires_passed_in_backlog(make_lab: Callable[..., Lab], tmp_path: Path,
                                   backlog: int) -> None:
    """Prefetched behind a busy process until their expires passed: each ends ``expired``.

    A backlog of many is what an outage leaves behind; Celery discards them one after the
    other when the process frees up.
    """
    lab = make_lab(worker_prefetch_multiplier=backlog + 5)  # all of them prefetched
    worker = lab.worker()
    gate = tmp_path / "gate"
    sleeper = _busy_with_sleeper(lab, gate)
    ids = [f"expiring-{uuid.uuid4().hex[:12]}" for _ in range(backlog)]
    sent = time.time()
    for task_id in ids:  # expires=3 s: the task's own option, applied by apply_async
        lab.client.tasks[f"{APP}.expiring"].apply_async(task_id=task_id)
    wait_for(lambda: all(lab.project.prefetched(i) for i in ids), 30,
             f"{backlog} task(s) to be prefetched")
    wait_for(lambda: time.time() > sent + 3.5, 10, "their expires to pass while they wait")
    gate.touch()
    wait_for(lambda: all(f"Discarding revoked task: {APP}.expiring[{i}]" in worker.process.logs()
                         for i in ids), 30, "Celery to discard every expired request")
    wait_for(lambda: all(lab.work_state(i) not in ("reserved", "requeued", "running")
                         for i in ids), 10, "every expired request to end in the store")
    states = Counter(lab.work_state(i) for i in ids)
    assert states == {"expired": backlog}, (
        f"expired requests ended as {dict(states)}\n{worker.process.all_logs()[-6000:]}")
    # Celery shows an expired request as REVOKED (reason 'expired'). One observation window
    # (on the last one discarded) covers the backlog; then all of them are checked again.
    lab.verify(ids[-1], worker, "expired", "REVOKED", runs=0)
    assert all(lab.runs(i) == 0 and lab.work_state(i) == "expired" for i in ids)
    assert all(lab.async_state(i) == "REVOKED" for i in ids)
    assert lab.work_state(sleeper) == "done"


# -- time limits ------------------------------------------------------------------------------


def test_soft_time_limit(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("soft_limit")
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "SoftTimeLimitExceeded"
    row = lab.store.get_work(task_id)
    assert row is not None and row.error is not None
    assert row.error.startswith("SoftTimeLimitExceeded")


def test_soft_limits_inside_store_calls_fail_once_and_the_process_goes_on(
        make_lab: Callable[..., Lab]) -> None:
    """Four tasks on one pool process hit their soft limit in a loop of checkpoint saves or
    steps, i.e. mostly while a statement waits for PostgreSQL. Each fails once with
    SoftTimeLimitExceeded (never a store outage that re-sends it), and the same process then
    runs ordinary tasks: no connection was left broken."""
    lab = make_lab()
    worker = lab.worker()
    limited = [lab.send("soft_limit_in_store", use_steps) for use_steps in
               (False, True, False, True)]
    after = [lab.send("succeed", n) for n in range(3)]
    for task_id in limited:
        lab.settle(task_id, worker, "failed", "FAILURE")
        assert lab.runs(task_id) == 1, lab.describe(task_id)
        assert _error(lab.meta(task_id)) == "SoftTimeLimitExceeded"
    for task_id in after:
        lab.settle(task_id, worker, "done", "SUCCESS")
    logs = worker.process.all_logs()
    assert "re-sent" not in logs and "store unavailable" not in logs, logs[-6000:]
    lab.holds(limited[-1], worker, "failed", "FAILURE", runs=1)
    assert all(lab.runs(task_id) == 1 for task_id in limited + after)


def test_hard_time_limit_fails_once_and_is_never_rerun(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("hard_limit")
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "TimeLimitExceeded"
    row = lab.store.get_work(task_id)
    assert row is not None and row.error is not None and "TimeLimitExceeded" in row.error
    assert "re-published orphaned work" not in worker.process.logs()


def test_a_hard_time_limit_the_store_missed_is_not_run_again(make_lab: Callable[..., Lab]
                                                             ) -> None:
    """Celery stores FAILURE and acks at a hard time limit; the main process records it in
    the store only after. The store is held up at that moment (a row lock stands in for a
    slow or unreachable store) and the worker is SIGKILLed: the restarted worker re-publishes
    the work it still sees running, and the copy must end it as the caller was told (plain
    Celery acked the message and never runs it again), not run the body a second time."""
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("hard_limit")
    wait_for(lambda: lab.runs(task_id) == 1, 30, "the task to run")
    w = lab.store.t.work
    with lab.store.engine.connect() as conn:
        tx = conn.begin()
        conn.execute(select(w.c.work_key).where(w.c.work_key == task_id).with_for_update())
        wait_for(lambda: lab.async_state(task_id) == "FAILURE", 30, "the caller to get FAILURE")
        worker.kill("SIGKILL")
        tx.rollback()
    assert lab.work_state(task_id) == "running", "the store heard of the time limit after all"
    worker.restart()
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "TimeLimitExceeded"
    assert "the caller was already told FAILURE" in worker.process.logs()


def test_a_database_crash_before_a_finish_is_flushed_runs_nothing_again(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        throwaway_pg: ThrowawayPostgres, tmp_path: Path) -> None:
    """A handed claim's finish commits without waiting for the WAL flush; the worker's main
    process flushes before it acknowledges. Here the main process is stopped (SIGSTOP)
    while the pool process finishes, Celery stores SUCCESS, and PostgreSQL crashes
    (``pg_ctl -m immediate``, its WAL writer slowed to 10 s) before anything flushed: the
    finish is lost. After the restart the main process flushes and acknowledges; the claim
    it still sees open is let go and re-published, and the copy must record the result the
    caller was told instead of running the body again."""
    engine = create_engine(throwaway_pg.url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.exec_driver_sql("ALTER SYSTEM SET wal_writer_delay = '10s'")
        conn.exec_driver_sql("SELECT pg_reload_conf()")
    engine.dispose()
    project = make_project(redis_url, throwaway_pg.url)
    project.extra = dict(FAST)
    lab = Lab(project, effect_log, redis_url)
    worker = lab.worker()
    wait_for(lambda: "batched_takes=on" in worker.process.logs(), 30, "the batched takes")
    gate = tmp_path / "gate"
    task_id = lab.send("sleeper", 60, str(gate))
    wait_for(lambda: lab.runs(task_id) == 1, 30, "the task to run")
    main = worker.process.main_pid
    assert main is not None
    os.kill(main, signal.SIGSTOP)
    try:
        gate.touch()  # the body returns: finish (unflushed), SUCCESS stored, result pending
        wait_for(lambda: lab.async_state(task_id) == "SUCCESS", 30, "the caller to get SUCCESS")
        wait_for(lambda: lab.work_state(task_id) == "done", 10, "the finish to commit")
        throwaway_pg.stop_immediately()
        throwaway_pg.start()
        lost = lab.work_state(task_id)
    finally:
        os.kill(main, signal.SIGCONT)
    assert lost == "running", f"the WAL writer flushed the finish first ({lost}): no window"
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=1)
    assert meta["result"] == "slept"
    row = lab.store.get_work(task_id)
    assert row is not None and codec.decode(row.result_json) == "slept"
    assert "the caller was already told SUCCESS" in worker.process.logs()


def test_a_kill_just_after_a_hard_time_limit_keeps_the_callers_exception(
        make_lab: Callable[..., Lab]) -> None:
    """SIGKILL a moment after the hard time limit: whatever copy comes back tells the caller
    the same ``TimeLimitExceeded`` (the store keeps the failure in Celery's form)."""
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("hard_limit")
    wait_for(lambda: "Hard time limit" in worker.process.logs(), 30, "the hard time limit")
    worker.kill("SIGKILL")
    worker.restart()
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "TimeLimitExceeded", meta
    row = lab.store.get_work(task_id)
    assert row is not None and row.result_json is not None
    assert codec.decode(row.result_json)["exc_type"] == "TimeLimitExceeded"


# -- deaths -----------------------------------------------------------------------------------


def test_on_resume_raising_fails_the_work(make_lab: Callable[..., Lab], tmp_path: Path) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("resume_fails", str(tmp_path / "died-once"))
    meta = lab.verify(task_id, worker, "failed", "FAILURE", runs=1)
    assert _error(meta) == "RuntimeError" and "cannot resume" in str(meta["result"])
    assert lab.effects.count(f"resume:{task_id}") == 1
    row = lab.store.get_work(task_id)
    assert row is not None and row.deaths == 1 and row.epoch == 2
    assert row.error is not None and row.error.startswith("RuntimeError: cannot resume")


def _checkpointed(lab: Lab, task_id: str) -> int:
    found = lab.store.load_checkpoint(task_id)
    return 0 if found is None else int(codec.decode(found[0])["row"])


def _assert_resumed(lab: Lab, task_id: str, rows: int, meta: dict[str, Any]) -> int:
    runs = lab.run_entries(task_id)
    resumed_from = int(runs[1]["seen"])
    assert runs[0]["seen"] == 0 and resumed_from >= 3, f"did not resume: {runs}"
    assert meta["result"] == {"rows": rows, "resumed_from": resumed_from}
    counts = lab.effects.counts()
    for i in range(rows):  # the row in flight when the process died may run twice
        assert counts[f"row:{task_id}:{i}"] in ((1, 2) if i == resumed_from else (1,)), i
    row = lab.store.get_work(task_id)
    # One takeover; the resumed run's checkpoints made progress, so deaths start again at 0.
    assert row is not None and row.epoch == 2 and row.attempts == 2 and row.deaths == 0
    return resumed_from


def test_worker_sigkill_mid_task_resumes_from_checkpoint(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("checkpointed", 12, 0.2)
    wait_for(lambda: _checkpointed(lab, task_id) >= 3, 30, "3 checkpointed rows")
    worker.kill("SIGKILL")
    saved = _checkpointed(lab, task_id)
    worker.restart()
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=2)
    assert _assert_resumed(lab, task_id, 12, meta) == saved


def test_pool_child_sigkill_resumes_from_checkpoint(make_lab: Callable[..., Lab]) -> None:
    lab = make_lab()
    worker = lab.worker()
    task_id = lab.send("checkpointed", 12, 0.2)
    wait_for(lambda: _checkpointed(lab, task_id) >= 3, 30, "3 checkpointed rows")
    worker.kill_pool_child()  # the main process lives: WorkerLostError
    meta = lab.verify(task_id, worker, "done", "SUCCESS", runs=2)
    _assert_resumed(lab, task_id, 12, meta)
