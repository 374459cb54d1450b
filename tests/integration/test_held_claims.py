"""The heartbeat renews only reserved claims whose message the worker still holds.

A reserved claim whose message was acknowledged without the work ending (a store-outage
re-send the broker then lost, found by the chaos soak) used to be renewed for as long as the
worker lived, so nobody ever re-published it.
"""

from __future__ import annotations

from celery_resilient.receipts import HeldRequests
from celery_resilient.store.sql import Receipt, Store

from .helpers import expire, owner, run


def test_unheld_reserved_claims_lapse_and_are_re_published(store: Store) -> None:
    me = owner("w@host")
    store.record_receipts([Receipt("held", "proj.task", "t-held", None, '{"m": 1}'),
                           Receipt("gone", "proj.task", "t-gone", None, '{"m": 2}')], me, 30)
    running = run(store, "busy", me, task_id="t-busy")
    for key in ("held", "gone", "busy"):
        expire(store, key, 1)
    held = HeldRequests()
    held.add("t-held")
    assert store.heartbeat(me, 30, held=held.snapshot()) == 2  # held + running
    orphans = store.claim_orphans(owner("other@host"), 10, 30)
    assert [o.work_key for o in orphans] == ["gone"]
    assert running.epoch == 1


def test_held_requests_count_copies_of_one_task_id() -> None:
    held = HeldRequests()
    held.add("t")  # the original
    held.add("t")  # its re-sent copy, received before the original is acknowledged
    held.release("t")
    assert held.snapshot() == frozenset({"t"})
    held.release("t")
    assert held.snapshot() == frozenset()
    held.release("t")  # never below zero
    held.add("t")
    assert held.snapshot() == frozenset({"t"})
