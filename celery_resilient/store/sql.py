"""``Store``: the facade the rest of the library calls (claims and takes, incarnations and
liveness proofs, sweeps, reads, checkpoints, steps and the ledger), on the plumbing of
:mod:`.db`. Callers see the plain records of :mod:`.records`, never SQL. The other query
modules (schedule, contexts, retention, operator and admin queries) build on :mod:`.db`
alone."""

from __future__ import annotations

import functools
import logging

from sqlalchemy import (
    func,
    select,
)

from celery_resilient.store.admin_queries import AdminQueries
from celery_resilient.store.claims import Claims
from celery_resilient.store.effects import BodyEffects
from celery_resilient.store.guard import guarded
from celery_resilient.store.operator_queries import OperatorQueries
from celery_resilient.store.records import (
    ENDED_PROCESS,
    ENDED_SESSION,
    ENDED_STOP,
    ENDED_SUCCESSOR,
    NO_CHECKPOINT,
    PROVEN_DEAD,
    REVOKE_LIST_ERROR,
    SESSION_ALIVE,
    UNJUDGED,
    Claim,
    Ended,
    GoneIncarnations,
    IncarnationRow,
    Orphan,
    Receipt,
    Resume,
    TakeAction,
    TakeOutcome,
    WorkInfo,
    work_info,
)
from celery_resilient.store.schedule import ScheduleStore
from celery_resilient.store.sweeps import Sweeps

log = logging.getLogger(__name__)
#: What callers import from here (the facade), defined in the modules below it
__all__ = [
    "ENDED_PROCESS", "ENDED_SESSION", "ENDED_STOP", "ENDED_SUCCESSOR", "NO_CHECKPOINT",
    "PROVEN_DEAD", "REVOKE_LIST_ERROR", "SESSION_ALIVE", "UNJUDGED", "Claim", "Ended",
    "GoneIncarnations", "IncarnationRow", "Orphan", "Receipt", "Resume", "Store",
    "TakeAction", "TakeOutcome", "WorkInfo", "guarded", "work_info",
]


class Store(Claims, Sweeps, BodyEffects):
    """The durable store: claims and takes (:mod:`.claims`), incarnations and liveness
    proofs (:mod:`.incarnations`), sweeps (:mod:`.sweeps`), checkpoints, steps and the
    ledger (:mod:`.effects`), on the plumbing of :mod:`.db`; the query modules off the hot
    path as attributes (``admin``, ``operator``, ``schedule``); and the reads operators and
    tests use.

    The hot-path concerns are mixed in rather than held as attributes: callers say
    ``store.take(...)``, ``store.save_checkpoint(...)``, naming the operation and not the
    module it lives in, with one attribute lookup on the paths each task runs."""

    # -- the query modules beside the hot path, built once per store ---------------------

    @functools.cached_property
    def admin(self) -> AdminQueries:
        """What operators read and prune (status, listings, detail, retention counts)."""
        return AdminQueries(self)

    @functools.cached_property
    def operator(self) -> OperatorQueries:
        """What operators change (re-publish, cancel, retry, forget)."""
        return OperatorQueries(self)

    @functools.cached_property
    def schedule(self) -> ScheduleStore:
        """Beat's slot records and markers."""
        return ScheduleStore(self)

    # -- reads for operators and tests ----------------------------------------------------

    @guarded
    def get_work(self, work_key: str) -> WorkInfo | None:
        w = self.t.work
        with self.reading() as conn:
            row = conn.execute(select(w).where(w.c.work_key == work_key)).first()
        return None if row is None else work_info(row)

    @guarded
    def get_message(self, work_key: str) -> str | None:
        """The stored broker message of ``work_key`` (what a re-publish would send)."""
        w = self.t.work
        with self.reading() as conn:
            value = conn.execute(select(w.c.message_json).where(w.c.work_key == work_key)
                                 ).scalar_one_or_none()
        return value

    @guarded
    def list_work(self, state: str | None = None, limit: int = 1000) -> list[WorkInfo]:
        w = self.t.work
        q = select(w).order_by(w.c.created_at).limit(limit)
        if state:
            q = q.where(w.c.state == state)
        with self.reading() as conn:
            rows = conn.execute(q).all()
        return [work_info(r) for r in rows]

    @guarded
    def count_by_state(self) -> dict[str, int]:
        w = self.t.work
        with self.reading() as conn:
            rows = conn.execute(select(w.c.state, func.count()).group_by(w.c.state)).all()
        return {str(s): int(n) for s, n in rows}
