"""Re-publishing orphans on demand, as ``celery -A proj resilient recover`` does.

The candidates are listed first (what the next sweep would take, and why); the recovery
itself is one round of the worker's own sweep (:func:`celery_resilient.worker.recovery.sweep`)
under an owner of its own, so an operator's recovery and a worker's never differ.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.admin_queries import OrphanCandidate
from celery_resilient.store.records import Orphan
from celery_resilient.store.sql import Store
from celery_resilient.worker import recovery


@dataclass(frozen=True)
class Candidates:
    """The orphans one sweep would re-publish (at most ``batch``), and the store's time."""

    rows: list[OrphanCandidate]
    now: float
    batch: int

    @property
    def full(self) -> bool:
        """Whether there may be more than this batch."""
        return len(self.rows) >= self.batch


@dataclass(frozen=True)
class Recovered:
    """What a recovery re-published, and the candidates it did not."""

    sent: list[Orphan]
    missed: list[OrphanCandidate]
    batch: int

    @property
    def more(self) -> bool:
        """A full batch was sent: running it again may find more."""
        return len(self.sent) >= self.batch


def candidates(rt: Runtime, store: Store, node: str | None = None) -> Candidates:
    """Open claims whose lease expired, and with ``node`` every open claim of that node."""
    batch = rt.config.sweep_batch
    rows = store.admin.orphan_candidates(batch, node)
    return Candidates(rows, store.now(), batch)


def recover(rt: Runtime, listed: Candidates, node: str | None, actor: str) -> Recovered:
    """One sweep of ``rt``'s store now, as a new incarnation of ``node`` (which takes every
    open claim of that node) or of ``actor@<host>``.

    ``listed`` is what was shown before; those the sweep did not send are reported (no
    stored message, a failed publish, or a worker's sweeper took them meanwhile).
    """
    who = Owner(node or f"{actor}@{socket.gethostname()}", uuid.uuid4().hex, os.getpid())
    sent = recovery.sweep(rt, who)
    sent_keys = {o.work_key for o in sent}
    missed = [c for c in listed.rows if c.work_key not in sent_keys]
    return Recovered(sent, missed, listed.batch)


def candidate_json(c: OrphanCandidate, now: float) -> dict[str, Any]:
    return {"work_key": c.work_key, "task": c.task_name, "task_id": c.task_id,
            "state": c.state, "owner": c.owner_node, "reason": c.reason,
            "lease_expired_s": None if c.lease_expires_at is None
            else round(now - c.lease_expires_at, 1),
            "counts_death": c.state == "running", "has_message": c.has_message}


def orphan_json(o: Orphan) -> dict[str, Any]:
    return {"work_key": o.work_key, "task": o.task_name, "task_id": o.task_id,
            "previous_state": o.previous_state, "previous_owner": o.previous_owner}


__all__ = ["Candidates", "Recovered", "candidate_json", "candidates", "orphan_json", "recover"]
