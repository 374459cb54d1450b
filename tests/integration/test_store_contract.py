"""The store contract: every test runs on SQLite, PostgreSQL and MariaDB (the ``store``
fixture).

Claims, fencing, leases, recovery, checkpoints, steps and the ledger, against the real
databases; the handles a task body uses are built from ``Execution`` as a worker builds them.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, event, func, select, text

from celery_resilient.core import codec
from celery_resilient.core.identity import pid_alive
from celery_resilient.errors import StaleClaimError, WorkKeyConflict
from celery_resilient.store.sql import Store
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.ledger import Ledger
from celery_resilient.tasks.steps import run_step

from .helpers import (
    died,
    execution,
    expire,
    expire_incarnation,
    never_live,
    owner,
    run,
    started,
    take,
)

# -- take -------------------------------------------------------------------------------


def test_take_new_key_runs_at_epoch_one(store: Store) -> None:
    me = owner()
    outcome = take(store, "k", me, task_id="t1", digest="d" * 64)
    assert outcome.action == "run"
    assert outcome.claim is not None
    assert (outcome.claim.epoch, outcome.claim.attempts, outcome.claim.deaths) == (1, 1, 0)
    row = store.get_work("k")
    assert row is not None
    assert (row.state, row.epoch, row.task_id, row.owner_node, row.incarnation) == (
        "running", 1, "t1", me.node, me.incarnation)
    assert row.lease_expires_at is not None
    assert row.lease_expires_at > store.now() + 25


def test_work_keys_compare_exactly(store: Store) -> None:
    """Case, accents and trailing spaces make different keys on every dialect (MySQL's
    default collations would fold the first two and pad the last)."""
    me = owner()
    keys = ["Key", "key", "key ", "kéy"]
    for key in keys:
        assert run(store, key, me).epoch == 1, key
    assert sorted(w.work_key for w in store.list_work()) == sorted(keys)


def test_large_payloads_round_trip(store: Store) -> None:
    """A checkpoint and a result past 64 KiB (MySQL's TEXT) are kept whole."""
    claim = run(store, "big", owner())
    state = codec.encode({"blob": "é" * 300_000})
    store.save_checkpoint("big", claim.epoch, state)
    found = store.load_checkpoint("big")
    assert found is not None and found[0] == state
    result = codec.encode(["x" * 200_000])
    store.finish("big", claim.epoch, result)
    row = store.get_work("big")
    assert row is not None and row.result_json == result


def test_take_of_done_returns_stored_result_without_a_new_epoch(store: Store) -> None:
    me = owner()
    claim = run(store, "k", me)
    store.finish("k", claim.epoch, codec.encode({"rows": 3}))
    for who in (me, owner("other@host")):
        outcome = take(store, "k", who, task_id="another-delivery")
        assert outcome.action == "done"
        assert outcome.claim is None
        assert codec.decode(outcome.result_json) == {"rows": 3}
    row = store.get_work("k")
    assert row is not None and (row.state, row.epoch, row.attempts) == ("done", 1, 1)


def test_take_held_by_a_live_other_owner_is_not_run(store: Store) -> None:
    run(store, "k", owner("a@host"))
    outcome = take(store, "k", owner("b@host"), is_live=never_live)
    assert outcome.action == "held"
    assert "a@host" in outcome.reason
    row = store.get_work("k")
    assert row is not None and (row.epoch, row.owner_node, row.deaths) == (1, "a@host", 0)


def test_take_after_lease_expired_takes_over(store: Store) -> None:
    run(store, "k", owner("a@host"))
    expire(store, "k")
    b = owner("b@host")
    claim = run(store, "k", b)
    assert (claim.epoch, claim.attempts, claim.deaths) == (2, 2, 1)
    row = store.get_work("k")
    assert row is not None and (row.owner_node, row.incarnation, row.deaths) == (
        b.node, b.incarnation, 1)


def test_take_of_an_earlier_incarnation_of_this_node_waits_for_its_liveness(
        store: Store) -> None:
    first = started(store, owner("a@host", incarnation="first-start"))
    run(store, "k", first)
    second = owner("a@host", incarnation="second-start")
    # Same node name, first start still holds its lease: a live duplicate, not a takeover.
    assert take(store, "k", second).action == "held"
    died(store, first)  # proven dead by the second start (or its lease expired)
    claim = run(store, "k", second)
    assert (claim.epoch, claim.deaths) == (2, 1)


def test_take_of_an_expired_incarnation_takes_over(store: Store) -> None:
    first = started(store, owner("a@host"))
    run(store, "k", first)
    assert take(store, "k", owner("b@host")).action == "held"
    expire_incarnation(store, first)
    claim = run(store, "k", owner("b@host"))
    assert (claim.epoch, claim.deaths) == (2, 1)


def test_take_same_incarnation_asks_liveness(store: Store) -> None:
    first = owner("a@host", incarnation="inc", pid=4242)
    run(store, "k", first)
    seen: list[tuple[Any, ...]] = []

    def alive(node: str | None, inc: str | None, pid: int | None) -> bool:
        seen.append((node, inc, pid))
        return True

    assert take(store, "k", owner("a@host", incarnation="inc"), is_live=alive).action == "held"
    assert seen == [("a@host", "inc", 4242)]
    claim = run(store, "k", owner("a@host", incarnation="inc"), is_live=never_live)
    assert (claim.epoch, claim.deaths) == (2, 1)


def test_take_same_incarnation_dead_pid_takes_over(store: Store) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run(store, "k", owner("a@host", incarnation="inc", pid=gone.pid))
    claim = run(store, "k", owner("a@host", incarnation="inc"),
                is_live=lambda node, inc, pid: pid_alive(pid))
    assert claim.epoch == 2


def test_deaths_reaching_max_attempts_mark_the_work_dead(store: Store) -> None:
    claim = run(store, "k", owner("a@host"), max_attempts=3)
    Checkpoint(execution(store, claim)).save({"row": 7})
    for expected_deaths in (1, 2):
        expire(store, "k")
        claim = run(store, "k", owner("a@host"), max_attempts=3)
        assert claim.deaths == expected_deaths
    expire(store, "k")
    outcome = take(store, "k", owner("a@host"), max_attempts=3)
    assert outcome.action == "dead"
    assert "died 3 times" in outcome.reason and "resilient_max_attempts=3" in outcome.reason
    row = store.get_work("k")
    assert row is not None
    assert (row.state, row.deaths, row.epoch, row.error) == ("dead", 3, 3, outcome.reason)
    # Not run again, whoever asks, and its last checkpoint is kept.
    again = take(store, "k", owner("b@host"), task_id="fresh-id", max_attempts=100)
    assert (again.action, again.reason) == ("dead", outcome.reason)
    assert store.get_work("k").epoch == 3  # type: ignore[union-attr]
    found = store.load_checkpoint("k")
    assert found is not None and codec.decode(found[0]) == {"row": 7}


def test_failed_with_same_task_id_replays_its_failure(store: Store) -> None:
    """A copy of a failed request runs nothing; it gets the stored failure, for Celery to be
    told again if the first telling died with its worker."""
    claim = run(store, "k", owner(), task_id="t1")
    failure = '{"exc_type": "ValueError", "exc_message": ["boom"], "exc_module": "builtins"}'
    store.fail("k", claim.epoch, "ValueError: boom", failure_json=failure)
    outcome = take(store, "k", owner(), task_id="t1")
    assert (outcome.action, outcome.result_json, outcome.reason) == (
        "failed", failure, "ValueError: boom")
    row = store.get_work("k")
    assert row is not None and (row.state, row.error, row.epoch) == (
        "failed", "ValueError: boom", 1)
    # A new message (a retry, a new send) for the same work does run.
    claim = run(store, "k", owner(), task_id="t2")
    assert claim.epoch == 2
    assert store.get_work("k").error is None  # type: ignore[union-attr]


def test_work_key_conflict_on_different_arguments(store: Store) -> None:
    run(store, "k", owner(), task_id="t1", digest="a" * 64)
    expire(store, "k")
    with pytest.raises(WorkKeyConflict) as info:
        take(store, "k", owner(), task_id="t2", digest="b" * 64)
    assert "t1" in str(info.value) and "'k'" in str(info.value)
    row = store.get_work("k")
    assert row is not None and (row.epoch, row.task_id) == (1, "t1")
    # Same arguments, or arguments that could not be digested, are not a conflict.
    assert run(store, "k", owner(), task_id="t3", digest="a" * 64).epoch == 2
    expire(store, "k")
    assert run(store, "k", owner(), task_id="t4", digest=None).epoch == 3


def test_concurrent_first_takes_run_once(store: Store) -> None:
    barrier = threading.Barrier(4)
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            barrier.wait(10)
            outcomes.append(take(store, "k", owner(f"w{n}@host"), is_live=never_live).action)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(outcomes) == ["held", "held", "held", "run"]


# -- fencing ----------------------------------------------------------------------------


def _superseded(store: Store) -> tuple[Any, Any]:
    """A claim at epoch 1 whose checkpoint is saved, then taken over at epoch 2."""
    old = run(store, "k", owner("a@host"))
    Checkpoint(execution(store, old)).save({"row": 5})
    expire(store, "k")
    new = run(store, "k", owner("b@host"))
    return old, new


def _assert_untouched(store: Store, new_epoch: int) -> None:
    found = store.load_checkpoint("k")
    assert found is not None
    assert codec.decode(found[0]) == {"row": 5}
    assert found[1] == 1
    row = store.get_work("k")
    assert row is not None
    assert (row.state, row.epoch, row.owner_node, row.result_json) == (
        "running", new_epoch, "b@host", None)
    assert store.get_step("k", "s") is None
    assert store.ledger_get("charge:1") is None


@pytest.mark.parametrize("write", [
    "checkpoint.save", "checkpoint.clear", "step", "ledger.once", "ledger.atomic", "finish",
    "fail", "release",
])
def test_stale_epoch_writes_are_refused_and_change_nothing(store: Store, write: str) -> None:
    old, new = _superseded(store)
    x = execution(store, old)
    effects: list[str] = []
    with pytest.raises(StaleClaimError) as info:
        if write == "checkpoint.save":
            Checkpoint(x).save({"row": 99})
        elif write == "checkpoint.clear":
            Checkpoint(x).clear()
        elif write == "step":
            run_step(x, "s", lambda: effects.append("step") or "r")
        elif write == "ledger.once":
            Ledger(store, x).once("charge:1", lambda: "charged")
        elif write == "ledger.atomic":
            with Ledger(store, x).atomic("charge:1") as tx:
                effects.append("atomic body")
                tx.result = "charged"
        elif write == "finish":
            store.finish("k", old.epoch, codec.encode("stale result"))
        elif write == "fail":
            store.fail("k", old.epoch, "boom")
        else:
            store.release("k", old.epoch, 10)
    assert "superseded" in str(info.value)
    assert "atomic body" not in effects  # refused before the user's writes
    _assert_untouched(store, new.epoch)


def test_claim_requeued_by_the_sweeper_fences_its_old_epoch(store: Store) -> None:
    old = run(store, "k", owner("a@host"))
    expire(store, "k")
    assert [o.work_key for o in store.claim_orphans(owner("sweeper@host"), 10, 30)] == ["k"]
    with pytest.raises(StaleClaimError):
        Checkpoint(execution(store, old)).save({"row": 1})
    assert store.load_checkpoint("k") is None


def test_the_current_epoch_still_writes_after_a_takeover(store: Store) -> None:
    _old, new = _superseded(store)
    x = execution(store, new)
    assert Checkpoint(x).save({"row": 6}) == 2
    assert run_step(x, "s", lambda: "ok") == "ok"
    store.finish("k", new.epoch, codec.encode("fine"))
    row = store.get_work("k")
    assert row is not None and (row.state, codec.decode(row.result_json)) == ("done", "fine")


# -- checkpoints ------------------------------------------------------------------------


def test_checkpoint_sequence_increments_and_never_goes_backwards(store: Store) -> None:
    claim = run(store, "k", owner("a@host"))
    cp = Checkpoint(execution(store, claim))
    assert cp.load(default={"row": 0}) == {"row": 0}
    assert [cp.save({"row": i}) for i in range(1, 4)] == [1, 2, 3]
    expire(store, "k")
    resumed = run(store, "k", owner("b@host"))
    cp2 = Checkpoint(execution(store, resumed))
    assert cp2.load(default={"row": 0}) == {"row": 3}
    assert cp2.sequence == 3
    assert cp2.save({"row": 4}) == 4  # the new epoch continues the sequence
    found = store.load_checkpoint("k")
    assert found is not None and found[1] == 4


def test_a_resumed_take_brings_its_checkpoint_and_the_first_load_reads_nothing(
        store: Store) -> None:
    claim = run(store, "k", owner("a@host"))
    Checkpoint(execution(store, claim)).save({"row": 7})
    expire(store, "k")
    resumed = run(store, "k", owner("b@host"))
    assert resumed.resume is not None and resumed.resume.found is not None
    assert codec.decode(resumed.resume.found[0]) == {"row": 7}
    assert resumed.resume.found[1] == 1
    cp = Checkpoint(execution(store, resumed))
    with _statements(store) as statements:
        assert cp.load(default={"row": 0}) == {"row": 7}
        assert statements == [], "the first load asked the store for what the take brought"
        assert cp.sequence == 1
        cp.save({"row": 8})
        statements.clear()
        assert cp.load(default={"row": 0}) == {"row": 8}  # after a save: the store's
        assert statements, "a load after a save did not read the store"
        cp.clear()
        assert cp.load(default={"row": 0}) == {"row": 0}
        expire(store, "k")
        fresh = Checkpoint(execution(store, run(store, "k", owner("c@host"))))
        statements.clear()
        assert fresh.load(default={"row": 0}) == {"row": 0}  # cleared: the take knew
        assert statements == [], "the first load asked the store for what the take brought"


@contextmanager
def _statements(store: Store) -> Iterator[list[str]]:
    """Every SQL statement the store runs inside the block."""
    statements: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    for engine in store.engines:
        event.listen(engine, "before_cursor_execute", seen)
    try:
        yield statements
    finally:
        for engine in store.engines:
            event.remove(engine, "before_cursor_execute", seen)


def test_checkpoint_default_is_a_copy(store: Store) -> None:
    cp = Checkpoint(execution(store, run(store, "k", owner())))
    default = {"rows": []}
    state = cp.load(default=default)
    state["rows"].append(1)
    assert default == {"rows": []}


def test_checkpoint_clear_removes_the_state(store: Store) -> None:
    cp = Checkpoint(execution(store, run(store, "k", owner())))
    cp.save({"row": 1})
    cp.clear()
    assert store.load_checkpoint("k") is None
    assert cp.load(default="fresh") == "fresh"


def test_checkpoints_of_different_work_are_separate(store: Store) -> None:
    a = Checkpoint(execution(store, run(store, "a", owner())))
    b = Checkpoint(execution(store, run(store, "b", owner())))
    a.save({"who": "a"})
    b.save({"who": "b"})
    b.save({"who": "b2"})
    assert (a.load(), b.load()) == ({"who": "a"}, {"who": "b2"})


# -- receipts, heartbeat, recovery ------------------------------------------------------


def test_record_receipt_reserves_new_work(store: Store) -> None:
    me = owner("a@host")
    store.record_receipt("k", "proj.task", "t1", None, '{"m": 1}', me, 30)
    row = store.get_work("k")
    assert row is not None
    assert (row.state, row.epoch, row.owner_node, row.incarnation) == (
        "reserved", 0, "a@host", me.incarnation)
    assert store.get_message("k") == '{"m": 1}'
    assert run(store, "k", me).epoch == 1


def test_record_receipt_does_not_clobber_a_running_claim(store: Store) -> None:
    a = owner("a@host")
    run(store, "k", a)
    before = store.get_work("k")
    store.record_receipt("k", "proj.task", "t-other", None, '{"m": 2}', owner("b@host"), 30)
    after = store.get_work("k")
    assert after is not None and before is not None
    assert (after.state, after.epoch, after.owner_node, after.incarnation, after.task_id) == (
        "running", 1, "a@host", a.incarnation, before.task_id)
    assert after.lease_expires_at == before.lease_expires_at


def test_record_receipt_does_not_reopen_done_work(store: Store) -> None:
    claim = run(store, "k", owner())
    store.finish("k", claim.epoch, codec.encode(1))
    store.record_receipt("k", "proj.task", "t-again", None, '{"m": 3}', owner("b@host"), 30)
    row = store.get_work("k")
    assert row is not None and (row.state, row.owner_node) == ("done", "worker@host")


def test_record_receipt_refreshes_requeued_work_keeping_its_message(store: Store) -> None:
    store.record_receipt("k", "proj.task", "t1", None, '{"m": 1}', owner("a@host"), 30)
    store.mark_stopped(owner("a@host", incarnation=store.get_work("k").incarnation), 30)  # type: ignore[union-attr]
    assert store.get_work("k").state == "requeued"  # type: ignore[union-attr]
    b = owner("b@host")
    store.record_receipt("k", "proj.task", "t1", None, None, b, 30)
    row = store.get_work("k")
    assert row is not None and (row.state, row.incarnation) == ("reserved", b.incarnation)
    assert store.get_message("k") == '{"m": 1}'


def _lease(store: Store, key: str) -> float:
    row = store.get_work(key)
    assert row is not None and row.lease_expires_at is not None
    return row.lease_expires_at


def test_heartbeat_renews_one_lease_row_whatever_the_number_of_claims(store: Store) -> None:
    me, other = started(store, owner("a@host"), lease=5), started(store, owner("b@host"))
    for i in range(20):
        run(store, f"mine-{i}", me, lease=5)
    run(store, "theirs", other, lease=5)
    claim_leases = {r.work_key: r.lease_expires_at for r in store.list_work()}

    with _statements(store) as statements:
        assert store.heartbeat(me, 600) is True
    writes = [s for s in statements if s.lstrip().upper().startswith(("UPDATE", "INSERT"))]
    assert len(writes) == 1 and f"{store.prefix}workers" in writes[0], writes
    assert not any(f"{store.prefix}work " in s or f"{store.prefix}work\n" in s
                   for s in writes)  # no claim row is touched (or locked)
    assert {r.work_key: r.lease_expires_at for r in store.list_work()} == claim_leases
    # Twenty claims on one incarnation: its lease keeps them all, long after their own.
    for i in range(20):
        expire(store, f"mine-{i}")
    assert store.claim_orphans(other, 100, 30) == []
    # A heartbeat of an incarnation another start declared dead says so.
    died(store, me)
    assert store.heartbeat(me, 600) is False
    assert store.heartbeat(owner("new@host"), 600) is True  # a pruned row comes back


def test_claim_orphans_takes_claims_of_gone_owners_only(store: Store) -> None:
    sweeper = started(store, owner("a@host", incarnation="now"))
    expired_owner = started(store, owner("b@host"))
    run(store, "expired-running", expired_owner)
    expire_incarnation(store, expired_owner)
    store.record_receipt("expired-reserved", "proj.task", "t", None, '{"m": 1}',
                         owner("c@host"), 30)  # an owner without a lease row: its own lease
    expire(store, "expired-reserved")
    earlier = owner("a@host", incarnation="before")
    run(store, "earlier-me", earlier)
    died(store, earlier)  # proven dead at the start of "now": taken at once
    live_other = started(store, owner("d@host"))
    run(store, "live-other", live_other)
    expire(store, "live-other")  # its own lease is irrelevant while its owner's lease lives
    run(store, "live-me", sweeper)
    finished = run(store, "finished", owner("e@host"))
    store.finish("finished", finished.epoch, None)
    expire(store, "finished")
    # While leases cannot be judged (the store was just down), only proven-dead owners.
    assert [o.work_key for o in store.claim_orphans(sweeper, 100, 30, judge_leases=False)
            ] == ["earlier-me"]
    store.unsend(["earlier-me"], 0)  # and make it an orphan again for the full sweep below
    expire(store, "earlier-me")

    orphans = store.claim_orphans(sweeper, 100, 30)
    by_key = {o.work_key: o for o in orphans}
    assert set(by_key) == {"expired-running", "expired-reserved", "earlier-me"}
    assert by_key["expired-running"].previous_state == "running"
    assert by_key["expired-running"].previous_owner == "b@host"
    assert by_key["expired-reserved"].message_json == '{"m": 1}'
    assert by_key["earlier-me"].task_id == "tid-earlier-me"
    now = store.now()
    for key in by_key:
        row = store.get_work(key)
        assert row is not None
        assert (row.state, row.owner_node, row.incarnation, row.republished) == (
            "requeued", None, None, 1)
        assert row.lease_expires_at is not None and row.lease_expires_at > now + 20
    # A running claim that died counts a death; a prefetched one does not.
    assert store.get_work("expired-running").deaths == 1  # type: ignore[union-attr]
    assert store.get_work("expired-reserved").deaths == 0  # type: ignore[union-attr]
    assert store.get_work("earlier-me").deaths == 1  # type: ignore[union-attr]
    for key in ("live-other", "live-me"):
        assert store.get_work(key).state == "running"  # type: ignore[union-attr]
    assert store.get_work("earlier-me").republished == 1  # type: ignore[union-attr]
    # Within the new lease nothing is returned twice; after it, the orphan is sent again.
    assert store.claim_orphans(sweeper, 100, 30) == []
    expire(store, "expired-reserved")
    again = store.claim_orphans(sweeper, 100, 30)
    assert [o.work_key for o in again] == ["expired-reserved"]
    assert store.get_work("expired-reserved").republished == 2  # type: ignore[union-attr]


def test_claim_orphans_respects_the_limit_oldest_first(store: Store) -> None:
    for n in range(5):
        run(store, f"k{n}", owner("b@host"))
        expire(store, f"k{n}")
    first = store.claim_orphans(owner("a@host"), 3, 30)
    assert [o.work_key for o in first] == ["k0", "k1", "k2"]
    assert [o.work_key for o in store.claim_orphans(owner("a@host"), 3, 30)] == ["k3", "k4"]


def test_an_orphan_taken_back_runs_at_the_next_epoch(store: Store) -> None:
    run(store, "k", owner("b@host"))
    expire(store, "k")
    store.claim_orphans(owner("a@host"), 10, 30)
    claim = run(store, "k", owner("a@host"))
    assert (claim.epoch, claim.deaths) == (2, 1)  # the death was counted once, by the sweep


def test_concurrent_sweepers_never_share_an_orphan(store: Store) -> None:
    keys = [f"orphan-{n:03d}" for n in range(40)]
    for key in keys:
        run(store, key, owner("dead@host"))
    past = store.now() - 60
    w = store.t.work
    with store.begin() as conn:
        conn.execute(w.update().values(lease_expires_at=past))

    barrier = threading.Barrier(2)
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def sweep(name: str) -> None:
        try:
            barrier.wait(10)
            results[name] = [o.work_key for o in store.claim_orphans(owner(name), 25, 30)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sweep, args=(f"s{n}@host",)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    first, second = results["s0@host"], results["s1@host"]
    assert not set(first) & set(second), "two sweepers re-published the same orphan"
    assert sorted(first + second) == keys
    assert all(r.republished == 1 for r in store.list_work())


def test_release_hands_the_work_back(store: Store) -> None:
    claim = run(store, "k", owner("a@host"))
    store.release("k", claim.epoch, 60)
    row = store.get_work("k")
    assert row is not None
    assert (row.state, row.owner_node, row.incarnation, row.epoch) == ("requeued", None, None, 1)
    assert row.lease_expires_at is not None and row.lease_expires_at > store.now() + 50
    retried = run(store, "k", owner("b@host"), task_id="tid-k")  # the retried message
    assert (retried.epoch, retried.deaths) == (2, 0)  # a retry is not a death
    with pytest.raises(StaleClaimError):
        store.release("k", claim.epoch, 60)


def test_mark_stopped_requeues_prefetched_work_only(store: Store) -> None:
    me, other = owner("a@host"), owner("b@host")
    store.record_receipt("prefetched", "proj.task", "t1", None, None, me, 30)
    run(store, "running", me)
    store.record_receipt("others", "proj.task", "t2", None, None, other, 30)
    store.heartbeat(me, 30)
    store.mark_stopped(me, 45)
    row = store.get_work("prefetched")
    assert row is not None and (row.state, row.owner_node, row.incarnation) == (
        "requeued", None, None)
    assert row.lease_expires_at is not None and row.lease_expires_at > store.now() + 40
    assert store.get_work("running").state == "running"  # type: ignore[union-attr]
    assert store.get_work("others").state == "reserved"  # type: ignore[union-attr]
    wk = store.t.workers
    with store.engine.connect() as conn:
        stopped = conn.execute(select(wk.c.stopped_at).where(
            wk.c.incarnation == me.incarnation)).scalar_one()
        conn.rollback()
    assert stopped is not None


# -- steps ------------------------------------------------------------------------------


def test_step_runs_once_and_replays_its_result(store: Store) -> None:
    calls: list[int] = []

    def effect(n: int, *, times: int) -> dict[str, int]:
        calls.append(n)
        return {"n": n * times}

    claim = run(store, "k", owner("a@host"))
    assert run_step(execution(store, claim), "notify", effect, 2, times=3) == {"n": 6}
    expire(store, "k")
    resumed = run(store, "k", owner("b@host"))
    assert run_step(execution(store, resumed), "notify", effect, 2, times=3) == {"n": 6}
    assert calls == [2]
    assert run_step(execution(store, resumed), "other", effect, 1, times=1) == {"n": 1}
    assert calls == [2, 1]


def test_steps_are_per_work_key(store: Store) -> None:
    a = execution(store, run(store, "a", owner()))
    b = execution(store, run(store, "b", owner()))
    assert run_step(a, "s", lambda: "from a") == "from a"
    assert run_step(b, "s", lambda: "from b") == "from b"


# -- ledger -----------------------------------------------------------------------------


def test_ledger_once_returns_the_stored_result_without_calling_again(store: Store) -> None:
    calls: list[str] = []

    def charge(invoice: int) -> str:
        calls.append("charge")
        return f"receipt-{invoice}"

    claim = run(store, "k", owner())
    ledger = Ledger(store, execution(store, claim))
    assert ledger.once("invoice:42", charge, 42) == "receipt-42"
    assert ledger.once("invoice:42", charge, 42) == "receipt-42"
    assert Ledger(store).once("invoice:42", charge, 42) == "receipt-42"  # global, no task
    assert calls == ["charge"]
    assert ledger.applied("invoice:42") and not ledger.applied("invoice:43")


@pytest.fixture
def user_table(store: Store) -> Table:
    """A table of the user's own in the store's database (dropped with the prefix)."""
    table = Table(f"{store.prefix}user_rows", MetaData(),
                  Column("id", Integer, primary_key=True, autoincrement=True),
                  Column("note", String(50), nullable=False))
    table.metadata.create_all(store.engine)
    return table


def _user_rows(store: Store, table: Table) -> list[str]:
    with store.engine.connect() as conn:
        rows = [r.note for r in conn.execute(select(table.c.note).order_by(table.c.id))]
        conn.rollback()
    return rows


def test_ledger_atomic_commits_user_sql_with_the_marker(store: Store,
                                                        user_table: Table) -> None:
    x = execution(store, run(store, "k", owner()))
    with Ledger(store, x).atomic() as tx:
        assert tx.applied is False
        tx.execute(user_table.insert().values(note="written"))
        tx.result = {"ok": True}
    assert _user_rows(store, user_table) == ["written"]
    assert codec.decode(store.ledger_get("k:atomic")) == {"ok": True}
    # A replay finds the key applied and skips its writes.
    with Ledger(store, x).atomic() as tx:
        assert tx.applied is True
    assert _user_rows(store, user_table) == ["written"]


def test_ledger_atomic_rolls_back_both_on_exception(store: Store, user_table: Table) -> None:
    x = execution(store, run(store, "k", owner()))
    with (pytest.raises(RuntimeError, match="crash mid-transaction"),
          Ledger(store, x).atomic("invoice:7") as tx):
        tx.execute(user_table.insert().values(note="lost"))
        raise RuntimeError("crash mid-transaction")
    assert _user_rows(store, user_table) == []
    assert store.ledger_get("invoice:7") is None
    with Ledger(store, x).atomic("invoice:7") as tx:
        assert tx.applied is False
        tx.execute(text(f"INSERT INTO {user_table.name} (note) VALUES ('second try')"))
    assert _user_rows(store, user_table) == ["second try"]
    assert store.ledger_get("invoice:7") is not None


def test_ledger_marker_names_the_writing_execution(store: Store) -> None:
    claim = run(store, "k", owner())
    Ledger(store, execution(store, claim)).once("key", lambda: 1)
    lg = store.t.ledger
    with store.engine.connect() as conn:
        row = conn.execute(select(lg.c.work_key, lg.c.epoch, func.count())
                           .group_by(lg.c.work_key, lg.c.epoch)).one()
        conn.rollback()
    assert (row[0], row[1], row[2]) == ("k", 1, 1)


def test_concurrent_atomic_on_one_key_applies_the_user_writes_once(
        store: Store, user_table: Table) -> None:
    """Two transactions for one key: the second must see the first's marker, not race it."""
    a_inside, b_inside = threading.Event(), threading.Event()
    applied: dict[str, bool] = {}
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with Ledger(store).atomic("invoice:9") as tx:
                applied["a"] = tx.applied
                if not tx.applied:
                    tx.execute(user_table.insert().values(note="a"))
                a_inside.set()
                # Bounded: a correct store keeps the second transaction out until this commits.
                b_inside.wait(1.5)
        except BaseException as exc:
            errors.append(exc)
            a_inside.set()

    def second() -> None:
        try:
            a_inside.wait(10)
            with Ledger(store).atomic("invoice:9") as tx:
                b_inside.set()
                applied["b"] = tx.applied
                if not tx.applied:
                    tx.execute(user_table.insert().values(note="b"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert applied == {"a": False, "b": True}
    assert _user_rows(store, user_table) == ["a"]


def test_ledger_once_reports_no_race_when_there_is_none(store: Store,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    x = execution(store, run(store, "k", owner()))
    with caplog.at_level("INFO", logger="celery_resilient.tasks.ledger"):
        assert Ledger(store, x).once("solo", lambda: "r") == "r"
    assert [r for r in caplog.records if getattr(r, "action", None) == "ledger_race"] == []


def test_ledger_mark_says_whether_it_inserted(store: Store) -> None:
    with store.begin() as conn:
        assert store.ledger_mark(conn, "m", None, None, "1") is True
        assert store.ledger_mark(conn, "m", None, None, "2") is False
    assert store.ledger_get("m") == "1"


def test_a_copy_that_supersedes_its_epoch_takes_over_without_a_death(store: Store) -> None:
    """The store went down mid-task: the execution re-sent itself naming its epoch and stopped."""
    run(store, "k", owner("a@host"))  # lease live, owner alive: only `supersedes` lets it in
    claim = run(store, "k", owner("b@host"), supersedes=1)
    assert (claim.epoch, claim.deaths) == (2, 0)
    # A copy naming an older epoch does not take a live claim.
    assert take(store, "k", owner("c@host"), supersedes=1).action == "held"


def test_record_receipts_batch_keeps_running_claims_and_fills_messages(store: Store) -> None:
    """The worker flushes many deliveries in one executemany statement."""
    from celery_resilient.store.sql import Receipt

    a, b = owner("a@host"), owner("b@host")
    run(store, "running-elsewhere", a)  # taken before its receipt was flushed: no message
    batch = [Receipt(f"k{i}", "proj.task", f"t{i}", None, f'{{"m": {i}}}') for i in range(3)]
    batch.append(Receipt("running-elsewhere", "proj.task", "t-dup", None, '{"m": "raw"}'))
    batch.append(Receipt("k0", "proj.task", "t0", None, '{"m": "again"}'))  # same key twice
    store.record_receipts(batch, b, 30)

    for i in range(3):
        row = store.get_work(f"k{i}")
        assert row is not None and row.state == "reserved" and row.owner_node == "b@host"
    assert store.get_message("k0") == '{"m": "again"}'
    kept = store.get_work("running-elsewhere")
    assert kept is not None and kept.state == "running" and kept.owner_node == "a@host"
    assert store.get_message("running-elsewhere") == '{"m": "raw"}'


def test_postgresql_connections_never_prepare_statements(pg_url: str, table_prefix: str) -> None:
    """No server-side prepared statement on the store's connections: every plan is a custom
    plan (a generic one scans the whole work table for the rare open states), and PgBouncer
    in transaction mode works. psycopg would prepare a statement on its fifth run."""
    store = Store(pg_url, table_prefix)
    store.migrate()
    try:
        who = owner("prep@host")
        for i in range(8):  # the same hot statements, more than five times each
            claim = run(store, f"prep-{i}", who)
            store.finish(f"prep-{i}", claim.epoch, "null")
        with store.engine.connect() as conn:
            prepared = conn.execute(text("SELECT count(*) FROM pg_prepared_statements")).scalar()
            conn.rollback()
        assert prepared == 0
    finally:
        store.dispose()
