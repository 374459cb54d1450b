"""Retention on demand, as ``celery -A proj resilient prune`` runs it: ended work with its
checkpoints and steps, old revocation tombstones, ledger markers only when asked, and the
rows of worker starts that ended long ago. The SQL is the store's
(:mod:`celery_resilient.store.admin_queries`, :mod:`celery_resilient.store.retention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_resilient.store.admin_queries import PruneCounts
from celery_resilient.store.operator_queries import prune_workers, prune_workers_count
from celery_resilient.store.sql import Store


@dataclass(frozen=True)
class Pruned:
    """Rows a prune deleted, or would delete: the store's counts and the worker starts."""

    counts: PruneCounts
    workers: int

    @property
    def total(self) -> int:
        return self.counts.total + self.workers

    def as_dict(self) -> dict[str, Any]:
        return {**self.counts.as_dict(), "workers": self.workers}

    def summary(self) -> str:
        c = self.counts
        return (f"{c.work} ended work ({c.checkpoints} checkpoints, {c.steps} steps), "
                f"{c.ledger} ledger markers, {c.revocations} revocation tombstones and "
                f"{self.workers} stopped worker starts")


def count(store: Store, older_than: float, ledger: bool, lease_seconds: float) -> Pruned:
    """What :func:`prune` would delete now; reads only."""
    counts = store.admin.prune_counts(older_than, ledger=ledger)
    return Pruned(counts, prune_workers_count(store, older_than, lease_seconds))


def prune(store: Store, older_than: float, ledger: bool, lease_seconds: float) -> Pruned:
    """Delete what ended more than ``older_than`` seconds ago (by the store's clock).

    A worker start's row goes only once it stopped, or its lease (``lease_seconds``) ran
    out, before the cutoff, and it owns no open work: a live worker's row is never deleted.
    """
    counts = store.admin.prune(older_than, ledger=ledger)
    return Pruned(counts, prune_workers(store, older_than, lease_seconds))


__all__ = ["Pruned", "count", "prune"]
