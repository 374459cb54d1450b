"""Small builders shared by the integration tests (claims, executions, expired leases)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from sqlalchemy import update

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.sql import Claim, Store, TakeOutcome
from celery_resilient.tasks.execution import Execution
from celery_resilient.testing import wait_for

__all__ = ["Owner", "died", "execution", "expire", "expire_incarnation", "owner", "run",
           "started", "take"]

Liveness = Callable[[str | None, str | None, int | None], bool]


def owner(node: str = "worker@host", incarnation: str | None = None,
          pid: int | None = None) -> Owner:
    return Owner(node, incarnation or uuid.uuid4().hex, pid or os.getpid())


def always_live(node: str | None, incarnation: str | None, pid: int | None) -> bool:
    return True


def never_live(node: str | None, incarnation: str | None, pid: int | None) -> bool:
    return False


def take(store: Store, key: str, who: Owner, *, task_id: str | None = None,
         digest: str | None = None, lease: float = 30.0, max_attempts: int = 5,
         is_live: Liveness = always_live, supersedes: int | None = None) -> TakeOutcome:
    return store.take(key, "proj.task", task_id or f"tid-{key}", digest, who, lease,
                      max_attempts, is_live, supersedes)


def run(store: Store, key: str, who: Owner, **kwargs: object) -> Claim:
    """Take ``key`` and insist that the outcome is ``run``."""
    outcome = take(store, key, who, **kwargs)  # type: ignore[arg-type]
    assert outcome.action == "run", outcome
    assert outcome.claim is not None
    return outcome.claim


def config(store: Store, **settings: object) -> ResilientConfig:
    return ResilientConfig.from_mapping({"resilient_store_url": store.url,
                                         "resilient_table_prefix": store.prefix,
                                         **{f"resilient_{k}": v for k, v in settings.items()}})


def execution(store: Store, claim: Claim, **settings: object) -> Execution:
    return Execution(store, config(store, **settings), claim.work_key, claim.epoch,
                     claim.attempts, resume_from=claim.resume)


def started(store: Store, who: Owner, lease: float = 30.0) -> Owner:
    """Record ``who`` as a worker incarnation holding a lease, as a worker start does."""
    store.register(who, "", lease)
    return who


def died(store: Store, who: Owner) -> None:
    """``who``'s incarnation is gone (a worker start proved it dead, or it stopped)."""
    store.register(who, "", 30)
    assert store.declare_dead(who.incarnation)


def expire_incarnation(store: Store, who: Owner, seconds_ago: float = 60.0) -> None:
    """Move an incarnation's lease into the past, as if it stopped renewing it."""
    wk = store.t.workers
    past = store.now() - seconds_ago
    with store.begin() as conn:
        conn.execute(update(wk).where(wk.c.incarnation == who.incarnation)
                     .values(lease_expires_at=past, heartbeat_at=past))


def expire(store: Store, key: str, seconds_ago: float = 60.0) -> None:
    """Move a claim's lease into the past, as if its owner stopped renewing it."""
    w = store.t.work
    past = store.now() - seconds_ago
    with store.begin() as conn:
        conn.execute(update(w).where(w.c.work_key == key).values(lease_expires_at=past))


def past_updates(store: Store, *keys: str) -> None:
    """Wait until the store's clock has moved past the last update of ``keys``: a reconcile
    with ``grace_seconds=0`` lets go only of claims strictly older than its now, and SQLite's
    clock has millisecond steps (a take and a reconcile can share one)."""
    def moved() -> bool:
        rows = [store.get_work(k) for k in keys]
        return all(r is not None for r in rows) and store.now() > max(
            r.updated_at for r in rows if r is not None)
    wait_for(moved, 5, f"the store's clock to pass the updates of {keys}")
