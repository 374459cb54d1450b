"""The group commit: results pool processes hand to the main process (tasks/handed_results.py),
committed by the dispatcher (worker/dispatch/) before their acknowledgements.

The pipe, the store and the dispatcher's thread are real; a forked child stands for the pool
process (it inherits the pipe as a pool process does). PostgreSQL only: on SQLite every pool
process finishes its own claim.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from celery_resilient.core import codec
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.batched_takes import Started, TakeRequest
from celery_resilient.store.sql import Store
from celery_resilient.tasks import handed_results
from celery_resilient.worker.dispatch import BatchedDispatch

from .helpers import started
from .test_dispatch_window import FinishedRequest, Hub, _consumer

pytestmark = pytest.mark.postgres


class Observed(FinishedRequest):
    """A request that records its claim's state in the store when it is acknowledged."""

    def __init__(self, task_id: str, store: Store, key: str) -> None:
        super().__init__(task_id)
        self.store, self.key = store, key
        self.state_at_ack: str | None = None

    def acknowledge_now(self) -> None:
        row = self.store.get_work(self.key)
        self.state_at_ack = None if row is None else row.state
        super().acknowledge_now()


@pytest.fixture
def channel() -> Iterator[None]:
    handed_results.open_channel()
    yield
    handed_results.Reader().drain()  # nothing left for the next test
    handed_results.accepting(False)


def _in_a_pool_process(work_key: str, epoch: int, result: object) -> bool:
    """Hand a result over from a forked child, as a pool process does; whether it was."""
    pid = os.fork()
    if pid == 0:  # the child: hand it over and leave at once (no cleanup of the parent's)
        os._exit(0 if handed_results.hand(work_key, epoch, codec.encode(result)) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _taken(store: Store, me: Owner, *keys: str) -> dict[str, int]:
    claims, _ = store.take_batch([TakeRequest(k, "proj.task", f"tid-{k}", 0, None, None, "{}")
                                  for k in keys], [], me, 30.0, 5)
    return {k: c.epoch for k, c in claims.items()}


def test_a_handed_result_is_done_in_the_store_before_its_ack(pg_store: Store,
                                                             channel: None) -> None:
    me = started(pg_store, Owner("gc@test", "inc-gc", os.getpid()))
    epochs = _taken(pg_store, me, "g1", "g2")
    d = BatchedDispatch(SimpleNamespace(store=pg_store, config=ResilientConfig()), me)  # type: ignore[arg-type]
    d.start()
    try:
        hub = Hub()
        d.attach(hub, _consumer())
        requests = [Observed(f"t-{k}", pg_store, k) for k in epochs]
        for request, (key, epoch) in zip(requests, epochs.items(), strict=True):
            d._claims[request] = (key, epoch)  # handed by a batch of takes
            assert _in_a_pool_process(key, epoch, {"sum": epoch}), "the pipe refused it"
            assert d.defer_ack(request)
        while any(r.acked == 0 for r in requests):
            hub.run_once()
    finally:
        d.stop()
    assert [r.state_at_ack for r in requests] == ["done", "done"]
    row = pg_store.get_work("g1")
    assert row is not None and codec.decode(row.result_json) == {"sum": epochs["g1"]}


def test_a_result_supersedes_a_lost_mark_of_its_claim(pg_store: Store, channel: None) -> None:
    """The pool process handed its result and then died: the main process's lost mark and
    the result meet in one batch; the result wins (one change per row and statement), so the
    requeued copy finds the work done."""
    me = started(pg_store, Owner("gc@test", "inc-lost", os.getpid()))
    epoch = _taken(pg_store, me, "lost")["lost"]
    rt = SimpleNamespace(store=pg_store, config=SimpleNamespace(lease_seconds=30.0,
                                                                max_attempts=5))
    d = BatchedDispatch(rt, me)  # type: ignore[arg-type]
    d.start()
    try:
        request = Observed("t-lost", pg_store, "lost")
        d._claims[request] = ("lost", epoch)
        assert _in_a_pool_process("lost", epoch, 7)
        d._mark(Started("lost", epoch, None))
        d._take_batch()  # (or the dispatcher's thread got there first: the same batch)
    finally:
        d.stop()
    row = pg_store.get_work("lost")
    assert row is not None and (row.state, row.incarnation) == ("done", me.incarnation)


def test_what_the_pipe_does_not_take_the_pool_process_finishes_itself(
        pg_store: Store, channel: None) -> None:
    """A result too big for one atomic write, or one handed while no dispatcher takes
    results (a warm shutdown stopped it), is refused: the pool process finishes itself."""
    handed_results.accepting(True)
    assert not _in_a_pool_process("big", 1, "x" * handed_results.MAX_RECORD)
    assert handed_results.Reader().drain() == []
    handed_results.accepting(False)
    assert not _in_a_pool_process("late", 1, 1)
    assert handed_results.Reader().drain() == []


def test_a_lost_connection_leaves_a_claim_whose_result_is_pending_to_its_result(
        pg_store: Store, channel: None) -> None:
    """Celery no longer knows a finished request; the consumer's connection drops (or a
    warm shutdown stops it) before the result was committed: its claim is not handed back
    (the result would be refused and the body run again, as a review found), the result is
    committed, and the maintainer's reconcile is told the work is finishing."""
    me = started(pg_store, Owner("gc@test", "inc-detach", os.getpid()))
    epoch = _taken(pg_store, me, "det")["det"]
    config = SimpleNamespace(submit_timeout=60.0, lease_seconds=30.0, max_attempts=5)
    d = BatchedDispatch(SimpleNamespace(store=pg_store, config=config),  # type: ignore[arg-type]
                        me)
    handed_results.accepting(True)  # the dispatcher's thread is not started: nothing commits yet
    request = Observed("t-det", pg_store, "det")
    d._claims[request] = ("det", epoch)
    assert _in_a_pool_process("det", epoch, "r")
    assert d.finishing() == frozenset({"det"})
    d.detach(known=set())
    d._release_claims()  # what the thread would hand back
    row = pg_store.get_work("det")
    assert row is not None and (row.state, row.epoch) == ("running", epoch)
    assert d._commit_finishes()
    row = pg_store.get_work("det")
    assert row is not None and row.state == "done"
    assert request not in d._claims


def test_a_finished_request_celery_dropped_before_it_started_holds_its_key_no_more(
        pg_store: Store, channel: None) -> None:
    """The pool ran a request and handed its result over, but Celery dropped its pool job at
    a lost connection before hearing that it started (the pool's flush), so the dispatcher
    never marked it started. Once detached it must not hold its key: the copies the broker
    delivers again would wait behind it for ever (a review: a live worker at prefetch 1 ran
    nothing more after a Redis connection cut)."""
    me = started(pg_store, Owner("gc@test", "inc-unstarted", os.getpid()))
    epoch = _taken(pg_store, me, "uns")["uns"]
    config = SimpleNamespace(submit_timeout=60.0, lease_seconds=30.0, max_attempts=5)
    d = BatchedDispatch(SimpleNamespace(store=pg_store, config=config),  # type: ignore[arg-type]
                        me)
    handed_results.accepting(True)
    request = Observed("t-uns", pg_store, "uns")
    d._claims[request] = ("uns", epoch)
    d._unstarted["uns"] = request  # handed on, never heard to start
    assert _in_a_pool_process("uns", epoch, "r")
    d.detach(known=set())
    assert "uns" not in d._unstarted, "copies of its key would be parked behind it"
    assert d._commit_finishes()
    row = pg_store.get_work("uns")
    assert row is not None and row.state == "done"
