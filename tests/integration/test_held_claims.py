"""The worker keeps only claims that run somewhere; the rest are released for the sweep.

A reserved claim whose message was acknowledged without the work ending (a store-outage
re-send the broker then lost, found by the chaos soak) used to be renewed for as long as the
worker lived, so nobody ever re-published it. The same for a running claim whose execution
never started or ended without recording it (a lost take reply, a failed re-send): the
incarnation's lease would keep it for as long as the worker lives.
"""

from __future__ import annotations

import os
import subprocess
import sys

from celery_resilient.core.identity import EAGER_SUFFIX, Owner, pid_alive
from celery_resilient.runtime.receipts import UnackedDeliveries
from celery_resilient.store.sql import Receipt, Store

from .helpers import expire, owner, past_updates, run, started


def test_unheld_reserved_claims_lapse_and_are_re_published(store: Store) -> None:
    me = started(store, owner("w@host"))
    store.record_receipts([Receipt("held", "proj.task", "t-held", None, '{"m": 1}'),
                           Receipt("gone", "proj.task", "t-gone", None, '{"m": 2}')], me, 30)
    running = run(store, "busy", me, task_id="t-busy")
    held = UnackedDeliveries()
    held.add("t-held")
    assert store.reconcile(me, held=held.snapshot()) == 1
    orphans = store.claim_orphans(owner("other@host"), 10, 30)
    assert [o.work_key for o in orphans] == ["gone"]
    assert running.epoch == 1
    assert store.get_work("held").state == "reserved"  # type: ignore[union-attr]


def test_running_claims_not_executing_are_let_go_after_the_grace(store: Store) -> None:
    me = started(store, owner("w@host"))
    run(store, "executing", me, task_id="t-exec")
    run(store, "lost", me, task_id="t-lost")  # its take committed; the body never started
    run(store, "resent", me, task_id="t-resent")  # re-sent itself: the store was down
    executing = frozenset({"t-exec"})
    # Just taken: the main process may not have heard of the request yet.
    assert store.reconcile(me, executing=executing, grace_seconds=30) == 0
    assert store.reconcile(me, executing=executing, grace_seconds=0,
                           resent=frozenset({"t-resent"}), resend_hold=600) == 2
    for key in ("lost", "resent"):
        row = store.get_work(key)
        assert row is not None and (row.state, row.incarnation, row.deaths) == (
            "requeued", None, 0), row  # no death: nothing died, the execution just ended
    orphans = store.claim_orphans(owner("other@host"), 10, 30)
    assert [(o.work_key, o.previous_state) for o in orphans] == [("lost", "requeued")]
    # The re-sent copy has its hold to take the claim; it does, without a death.
    copy = run(store, "resent", owner("other@host"), task_id="t-resent")
    assert (copy.epoch, copy.deaths) == (2, 0)
    assert store.get_work("executing").state == "running"  # type: ignore[union-attr]
    # Unknown (None): nothing is judged by it.
    run(store, "unknown", me, task_id="t-unknown")
    assert store.reconcile(me, executing=None, grace_seconds=0) == 0


def test_a_claim_whose_result_waits_for_the_group_commit_is_not_let_go(store: Store) -> None:
    """Its body ended (no request executes it) and its pool process is alive, but its result
    waits in the main process for the next statement (a store outage can make that seconds):
    it is not an execution that ended without an outcome."""
    me = started(store, owner("w@host"))
    run(store, "finishing", me, task_id="t-fin")
    run(store, "ended", me, task_id="t-ended")
    past_updates(store, "finishing", "ended")
    assert store.reconcile(me, executing=frozenset(), grace_seconds=0,
                           finishing=frozenset({"finishing"})) == 1
    assert store.get_work("finishing").state == "running"  # type: ignore[union-attr]
    assert store.get_work("ended").state == "requeued"  # type: ignore[union-attr]


def test_held_requests_count_copies_of_one_task_id() -> None:
    held = UnackedDeliveries()
    held.add("t")  # the original
    held.add("t")  # its re-sent copy, received before the original is acknowledged
    held.release("t")
    assert held.snapshot() == frozenset({"t"})
    held.release("t")
    assert held.snapshot() == frozenset()
    held.release("t")  # never below zero
    held.add("t")
    assert held.snapshot() == frozenset({"t"})


def test_a_lost_broker_connection_lets_go_of_what_celery_forgot() -> None:
    """After a dropped connection Celery keeps only its executing requests (and reserved or
    ETA ones it did not drop); every other held id goes, copies and all (the e2e proof:
    tests/e2e/test_claims.py::test_a_broker_restart_strands_no_prefetched_work)."""
    held = UnackedDeliveries()
    for task_id in ("running", "prefetched", "prefetched", "eta"):
        held.add(task_id)
    assert held.retain({"running", "eta", "unrelated"}) == 1
    assert held.snapshot() == frozenset({"running", "eta"})
    held.release("eta")
    assert held.retain(set()) == 1
    assert held.snapshot() == frozenset()


def test_eager_claims_of_live_processes_keep_their_own_lease(store: Store) -> None:
    """task.apply() inside a task on a worker: no Celery request accounts for it. It must
    not be let go as "not executing" and re-run on another worker."""
    me = started(store, owner("w@host"))
    live = Owner(me.node, me.incarnation + EAGER_SUFFIX, os.getpid())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = Owner(me.node, me.incarnation + EAGER_SUFFIX, gone.pid)
    run(store, "nested", live, task_id="t-nested")
    run(store, "nested-of-a-dead-process", dead, task_id="t-dead")
    expire(store, "nested")
    expire(store, "nested-of-a-dead-process")
    assert store.reconcile(me, pid_alive, executing=frozenset(), grace_seconds=0) == 0
    orphans = store.claim_orphans(owner("other@host"), 10, 30)
    assert [o.work_key for o in orphans] == ["nested-of-a-dead-process"]
    assert store.get_work("nested").state == "running"  # type: ignore[union-attr]
