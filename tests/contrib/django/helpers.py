"""Work in every state, made through the store's own API (no hand-written rows)."""

from __future__ import annotations

import json

from celery_resilient.core import codec, messages
from celery_resilient.core.identity import Owner
from celery_resilient.store.sql import Store

TASK = "djproj.noop"
LIVE = Owner("live@host", "inc-live", 101)


def message(task_id: str, queue: str) -> str:
    body = json.dumps([[1], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                 "chord": None}])
    headers = {"lang": "py", "task": TASK, "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None}
    return messages.from_publish(body, "application/json", "utf-8", headers, {}, "", queue)


def reserved(store: Store, key: str, queue: str, owner: Owner = LIVE) -> None:
    store.record_receipt(key, TASK, key, None, message(key, queue), owner, 60)


def running(store: Store, key: str, queue: str, lease: float = 60,
            owner: Owner = LIVE) -> int:
    reserved(store, key, queue, owner)
    outcome = store.take(key, TASK, key, None, owner, lease, 5, is_live=lambda *_: True)
    assert outcome.action == "run" and outcome.claim is not None
    return outcome.claim.epoch


def done(store: Store, key: str, queue: str) -> None:
    epoch = running(store, key, queue)
    store.finish(key, epoch, codec.encode({"ok": True}, "result"))


def dead(store: Store, key: str, queue: str) -> None:
    """Killed with its worker once, then refused with resilient_max_attempts=1."""
    doomed = Owner(f"doomed-{key}@host", "inc-1", 7)
    running(store, key, queue, owner=doomed)
    restarted = Owner(doomed.node, "inc-2", 8)
    store.register(doomed, "", 60)
    store.declare_dead(doomed.incarnation)  # the restart proved it dead
    assert [o.work_key for o in store.claim_orphans(restarted, 10, 60)] == [key]
    outcome = store.take(key, TASK, key, None, restarted, 60, 1, is_live=lambda *_: False)
    assert outcome.action == "dead"


def failed(store: Store, key: str, queue: str, error: str = "ValueError: bad row") -> None:
    store.fail(key, running(store, key, queue), error)


def revoked(store: Store, key: str, queue: str) -> None:
    """Revoked by task id before it started (its tombstone is kept in the store)."""
    reserved(store, key, queue)
    assert store.record_revocations([key]) == 1
