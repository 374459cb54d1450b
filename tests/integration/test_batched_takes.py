"""Batched takes (store/batched_takes.py): what the worker's main process takes before the
pool runs a request, and how a claim taken that way but never seen to start is judged.

Every test runs on SQLite, PostgreSQL and MariaDB (the ``store`` fixture)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import insert, update

from celery_resilient.core import codec
from celery_resilient.core.states import UNSTARTED_PID
from celery_resilient.store.batched_takes import Finish, Started, TakeRequest
from celery_resilient.store.sql import Receipt, Store

from .helpers import died, never_live, owner, past_updates, run, started, take


def request(key: str, task_id: str | None = None, retries: int = 0,
            supersedes: int | None = None, digest: str | None = None) -> TakeRequest:
    return TakeRequest(key, "proj.task", task_id or f"tid-{key}", retries, supersedes, digest,
                       f'{{"message": "{key}"}}')


def batch(store: Store, who: object, *takes: TakeRequest,
          marks: tuple[Started, ...] = (), max_attempts: int = 5) -> dict[str, int]:
    """Take ``takes`` in one batch; the epochs taken, by work key."""
    claims, _ = store.take_batch(list(takes), list(marks), who, 30.0, max_attempts)  # type: ignore[arg-type]
    return {k: c.epoch for k, c in claims.items()}


def test_new_keys_are_taken_running_unstarted_with_their_message(store: Store) -> None:
    me = started(store, owner())
    assert batch(store, me, request("a"), request("b")) == {"a": 1, "b": 1}
    for key in ("a", "b"):
        row = store.get_work(key)
        assert row is not None
        assert (row.state, row.epoch, row.attempts, row.deaths, row.owner_pid,
                row.incarnation) == ("running", 1, 1, 0, UNSTARTED_PID, me.incarnation)
        assert row.lease_expires_at is not None and row.lease_expires_at > store.now() + 25
    assert store.get_message("a") == '{"message": "a"}'


def test_reserved_and_requeued_claims_are_taken_with_their_checkpoint(store: Store) -> None:
    me = started(store, owner())
    store.record_receipts([Receipt("r", "proj.task", "tid-r", None, '{"m": "receipt"}')], me,
                          30)
    first = run(store, "q", me, task_id="tid-q")
    store.save_checkpoint("q", first.epoch, codec.encode({"row": 7}))
    store.release("q", first.epoch, 0.0, 0)  # handed back (a retry, say)
    claims, _ = store.take_batch([request("r"), request("q")], [], me, 30.0, 5)
    assert {k: c.epoch for k, c in claims.items()} == {"r": 1, "q": 2}
    assert claims["r"].resume is not None and claims["r"].resume.found is None
    assert claims["q"].resume is not None and claims["q"].resume.found is not None
    assert codec.decode(claims["q"].resume.found[0]) == {"row": 7}
    assert store.get_message("r") == '{"m": "receipt"}', "the delivered message is kept"


def test_what_the_careful_take_must_decide_is_left_untouched(store: Store) -> None:
    me = started(store, owner())
    other = started(store, owner("other@host"))
    run(store, "running", other)
    done = run(store, "done", me)
    store.finish("done", done.epoch, codec.encode(1))
    failed = run(store, "failed", me)
    store.fail("failed", failed.epoch, "ValueError: x")
    store.record_revocations(["tid-revoked"])
    store.record_receipts([Receipt("revoked", "proj.task", "tid-revoked", None, "{}")], me, 30)
    retried = run(store, "stale-try", me)
    store.release("stale-try", retried.epoch, 0.0, next_retries=2)
    replaced = run(store, "replaced", me)
    store.release("replaced", replaced.epoch, 0.0, 0, replaced=True)
    digest = run(store, "digest", me, digest="a" * 64)
    store.release("digest", digest.epoch, 0.0, 0)
    w = store.t.work
    with store.begin() as conn:  # a receipt whose claim died max_attempts times
        conn.execute(insert(w).values(
            work_key="poison", task_name="proj.task", task_id="tid-poison", state="reserved",
            epoch=4, attempts=5, deaths=5, republished=0, created_at=0, updated_at=0))
        conn.execute(update(w).where(w.c.work_key == "digest").values(args_digest="a" * 64))
    before = {k: store.get_work(k) for k in ("running", "done", "failed", "revoked",
                                             "stale-try", "replaced", "digest", "poison")}
    takes = [request("running"), request("done", task_id="another"),
             request("failed", task_id="tid-failed"), request("revoked"),
             request("stale-try", retries=1), request("replaced", task_id="tid-replaced"),
             request("digest", digest="b" * 64), request("poison")]
    assert batch(store, me, *takes) == {}
    assert {k: store.get_work(k) for k in before} == before


def test_a_replacement_takes_the_claim_handed_to_it(store: Store) -> None:
    me = started(store, owner())
    first = run(store, "k", me, task_id="t")
    store.release("k", first.epoch, 0.0, 0, replaced=True)
    assert batch(store, me, request("k", task_id="t", supersedes=first.epoch)) == {
        "k": first.epoch + 1}


def test_started_marks_name_the_pool_process_and_lost_ones_clear_the_owner(
        store: Store) -> None:
    me = started(store, owner())
    batch(store, me, request("a"), request("b"))
    batch(store, me, marks=(Started("a", 1, 4242), Started("b", 1, None),
                            Started("a", 9, 1)))  # a mark of another epoch changes nothing
    a, b = store.get_work("a"), store.get_work("b")
    assert a is not None and (a.owner_pid, a.incarnation) == (4242, me.incarnation)
    assert b is not None and (b.state, b.owner_pid, b.incarnation) == ("running", None, None)
    outcome = take(store, "b", me, task_id="tid-b")
    assert outcome.action == "run" and outcome.claim is not None
    assert outcome.claim.deaths == 1, "a pool process that died running it: one death"


def test_its_own_worker_holds_an_unstarted_claim_live(store: Store) -> None:
    me = started(store, owner())
    batch(store, me, request("k"))
    outcome = take(store, "k", me, task_id="tid-k", is_live=never_live)
    assert outcome.action == "held", "a copy must not run beside the request its worker holds"


def test_taking_over_an_unstarted_claim_of_a_dead_worker_counts_no_death(
        store: Store) -> None:
    gone = started(store, owner("gone@host"))
    batch(store, gone, request("k"), request("s"))
    batch(store, gone, marks=(Started("s", 1, 4242),))
    died(store, gone)
    me = started(store, owner())
    unstarted = take(store, "k", me, task_id="tid-k")
    begun = take(store, "s", me, task_id="tid-s")
    assert unstarted.claim is not None and unstarted.claim.deaths == 0
    assert begun.claim is not None and begun.claim.deaths == 1


def test_the_sweep_counts_no_death_for_an_unstarted_claim(store: Store) -> None:
    gone = started(store, owner("gone@host"))
    batch(store, gone, request("k"), request("s"))
    batch(store, gone, marks=(Started("s", 1, 4242),))
    died(store, gone)
    orphans = store.claim_orphans(owner("sweeper@host"), 10, 30)
    assert sorted(o.work_key for o in orphans) == ["k", "s"]
    k, s = store.get_work("k"), store.get_work("s")
    assert k is not None and (k.state, k.deaths, k.republished) == ("requeued", 0, 1)
    assert s is not None and (s.state, s.deaths) == ("requeued", 1)


def test_a_clean_stop_hands_unstarted_claims_back(store: Store) -> None:
    me = started(store, owner())
    batch(store, me, request("k"), request("s"))
    batch(store, me, marks=(Started("s", 1, 4242),))
    store.mark_stopped(me, 60)
    k, s = store.get_work("k"), store.get_work("s")
    assert k is not None and (k.state, k.incarnation, k.owner_pid) == ("requeued", None, None)
    assert s is not None and s.state == "running", "a started claim is an orphan, not handed back"


def test_a_worker_cut_off_from_its_broker_lets_unstarted_claims_go(store: Store) -> None:
    me = started(store, owner())
    batch(store, me, request("k"), request("s"))
    batch(store, me, marks=(Started("s", 1, 4242),))
    assert store.release_reserved(me) == 1
    k, s = store.get_work("k"), store.get_work("s")
    assert k is not None and (k.state, k.incarnation) == ("requeued", None)
    assert s is not None and (s.state, s.incarnation) == ("running", me.incarnation)


def test_reconcile_keeps_unstarted_claims_of_held_requests(store: Store) -> None:
    me = started(store, owner())
    batch(store, me, request("held"), request("gone"))
    past_updates(store, "held", "gone")
    assert store.reconcile(me, pid_alive=lambda pid: False,
                           held=frozenset({"tid-held"}), executing=frozenset(),
                           grace_seconds=0) == 1
    held, gone = store.get_work("held"), store.get_work("gone")
    assert held is not None and (held.state, held.owner_pid) == ("running", UNSTARTED_PID)
    assert gone is not None and (gone.state, gone.deaths) == ("requeued", 0)


def test_a_finish_that_does_not_wait_for_the_flush_changes_no_session_setting(
        store: Store) -> None:
    """The finish of a handed claim commits without waiting for the WAL flush (PostgreSQL) by
    a transaction-local setting: the pooled connection it ran on keeps the server's setting
    (behind a pooler it may serve another client next)."""
    me = started(store, owner())
    claims, _ = store.take_batch([request("k")], [], me, 30.0, 5)
    store.finish("k", claims["k"].epoch, codec.encode(42), flushed=False)
    store.flush()
    row = store.get_work("k")
    assert row is not None and row.state == "done" and codec.decode(row.result_json) == 42
    if not store.dialect.group_commits:  # SQLite, MySQL: every finish waits for its flush
        return
    with store.single() as conn:  # the autocommit pool the finish ran on (one connection)
        setting = conn.exec_driver_sql("SHOW synchronous_commit").scalar_one()
    assert setting == "on"


def test_the_group_commit_records_results_under_their_epoch_only(store: Store) -> None:
    """Results handed by pool processes are committed ``done`` by the main process's batch
    (PostgreSQL): a result whose claim moved on (another epoch) changes nothing and is not
    reported finished. SQLite and MySQL refuse them: their pool processes finish their own
    claims."""
    me = started(store, owner())
    claims, _ = store.take_batch([request("a"), request("b")], [], me, 30.0, 5)
    fins = [Finish("a", claims["a"].epoch, codec.encode("ra")),
            Finish("b", claims["b"].epoch + 1, codec.encode("rb"))]
    if not store.dialect.group_commits:
        with pytest.raises(ValueError, match="PostgreSQL only"):
            store.take_batch([], [], me, 30.0, 5, fins)
        return
    taken, finished = store.take_batch([request("c")], [], me, 30.0, 5, fins)
    assert set(taken) == {"c"} and finished == {"a"}
    a, b = store.get_work("a"), store.get_work("b")
    assert a is not None and (a.state, a.owner_pid, a.lease_expires_at) == ("done", None, None)
    assert codec.decode(a.result_json) == "ra" and a.finished_at is not None
    assert b is not None and b.state == "running" and b.result_json is None


@pytest.mark.parametrize("parts", range(16), ids=lambda n: f"parts{n:04b}")
def test_every_combination_of_a_batch_s_parts_does_each_part_s_work(
        pg_store: Store, parts: int) -> None:
    """PostgreSQL sends only the parts of the statement a batch has rows for (started
    marks, lost marks, takes, results): each of the 16 statements does exactly its parts'
    work, and a part left out leaves its rows alone."""
    store = pg_store
    with_started, with_lost, with_takes, with_finishes = (bool(parts & bit)
                                                          for bit in (8, 4, 2, 1))
    me = started(store, owner())
    claims, _ = store.take_batch([request("s"), request("l"), request("f")], [], me, 30.0, 5)
    marks = ([Started("s", claims["s"].epoch, 4242)] if with_started else []) + (
        [Started("l", claims["l"].epoch, None)] if with_lost else [])
    fins = [Finish("f", claims["f"].epoch, codec.encode("rf"))] if with_finishes else []
    taken, finished = store.take_batch([request("t")] if with_takes else [], marks, me, 30.0,
                                       5, fins)
    assert set(taken) == ({"t"} if with_takes else set())
    assert finished == ({"f"} if with_finishes else set())
    s, lost, f, t = (store.get_work(k) for k in ("s", "l", "f", "t"))
    assert s is not None and s.owner_pid == (4242 if with_started else UNSTARTED_PID)
    assert lost is not None and (lost.owner_pid, lost.incarnation) == (
        (None, None) if with_lost else (UNSTARTED_PID, me.incarnation))
    assert f is not None and f.state == ("done" if with_finishes else "running")
    assert (t is not None and t.state == "running") == with_takes


def test_a_mark_on_a_row_a_transaction_holds_waits_for_a_later_batch_not_the_batch(
        store: Store) -> None:
    """A body's ``ledger.atomic()`` holds its work row (its fence) until it commits. A
    started mark of that row must not make the batch wait on it, with every other delivery's
    take behind it: the mark is skipped (``deferred``), the rest is written at once, and the
    mark is written by a batch after the block ended."""
    if store.dialect.is_sqlite:
        pytest.skip("SQLite has one writer: a held transaction blocks every batch by design")
    me = started(store, owner())
    epoch = batch(store, me, request("held"))["held"]
    release = threading.Event()
    fenced = threading.Event()

    def atomic_block() -> None:
        with store.begin() as conn:
            store.fence(conn, "held", epoch)  # the row lock a ledger.atomic() block holds
            fenced.set()
            release.wait(30)

    holder = threading.Thread(target=atomic_block)
    holder.start()
    try:
        assert fenced.wait(10)
        deferred: list[Started] = []
        began = time.monotonic()
        claims, _ = store.take_batch([request("other")], [Started("held", epoch, 4242)], me,
                                     30.0, 5, deferred=deferred)
        took = time.monotonic() - began
        assert set(claims) == {"other"} and deferred == [Started("held", epoch, 4242)]
        assert took < 5, f"the batch waited {took:.1f}s on the held row"
        held = store.get_work("held")
        assert held is not None and held.owner_pid == UNSTARTED_PID
    finally:
        release.set()
        holder.join(10)
    later: list[Started] = []
    store.take_batch([], deferred, me, 30.0, 5, deferred=later)
    held = store.get_work("held")
    assert later == [] and held is not None and held.owner_pid == 4242
