"""Every query the operator commands run (``celery -A proj resilient ...``).

Reads never lock and never change a row: ``status``, ``work``, ``schedule`` and every
``--dry-run`` are safe on a live system. The only writes here are the retention deletes of
``prune`` (those of :mod:`.retention`), batched so a large backlog never holds one long
transaction. The operator's
transitions (cancel, retry, forget) are in :mod:`.operator_queries`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, case, func, or_, select

from celery_resilient.core.states import CLAIMED, DEAD, OPEN_STATES
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.records import WorkInfo, work_info
from celery_resilient.store.retention import (
    FINISHED_STATES,
    PRUNE_BATCH,
    delete_finished_work,
    delete_ledger_markers,
    delete_revocations,
    finished_before,
    ledger_before,
    revocations_before,
)


@dataclass(frozen=True)
class CheckpointInfo:
    epoch: int
    seq: int
    state_json: str
    updated_at: float


@dataclass(frozen=True)
class StepInfo:
    name: str
    epoch: int
    result_json: str
    created_at: float


@dataclass(frozen=True)
class LedgerInfo:
    key: str
    epoch: int | None
    applied_at: float


@dataclass(frozen=True)
class WorkDetail:
    work: WorkInfo
    checkpoint: CheckpointInfo | None
    steps: tuple[StepInfo, ...]
    ledger: tuple[LedgerInfo, ...]
    message_route: tuple[str, str] | None  # (exchange, routing key) of the stored message


@dataclass(frozen=True)
class OrphanCandidate:
    """An open claim the next sweep (or ``recover``) would re-publish, and why."""

    work_key: str
    task_name: str
    task_id: str
    state: str
    owner_node: str | None
    lease_expires_at: float | None
    deaths: int
    has_message: bool
    reason: str  # "lease_expired" or "node_gone"


@dataclass(frozen=True)
class Status:
    now: float
    by_state: dict[str, int]
    by_owner: list[tuple[str, str | None, int]]  # (state, owner node, count) of open work
    oldest_lease: tuple[str, float] | None  # (work key, expires at) among open claims
    expired_leases: int
    dead: list[WorkInfo]
    slots_pending: int
    oldest_pending_slot_claim: float | None
    contexts: int
    oldest_context: float | None
    workers: list[tuple[str, str, float, float | None]] = field(default_factory=list)
    # (node, incarnation, last heartbeat, stopped at) of recently seen worker starts


@dataclass(frozen=True)
class EntrySlots:
    """One beat entry: its durable marker and what its slot records say."""

    entry: str
    last_slot: float
    definition_json: str | None
    updated_at: float
    sent: int
    skipped: int
    pending: int
    oldest_pending_claim: float | None
    last_sent_slot: float | None


@dataclass(frozen=True)
class PruneCounts:
    work: int = 0
    checkpoints: int = 0
    steps: int = 0
    ledger: int = 0
    revocations: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"work": self.work, "checkpoints": self.checkpoints, "steps": self.steps,
                "ledger": self.ledger, "revocations": self.revocations}

    @property
    def total(self) -> int:
        """Rows deleted; a checkpoint is part of its work row (counted on its own only to
        say how many units had one)."""
        return self.work + self.steps + self.ledger + self.revocations


class AdminQueries:
    """Read-only inspection and retention pruning, on a store's plumbing (:mod:`.db`)."""

    def __init__(self, store: Database) -> None:
        self.store = store
        self.t = store.t

    def _read(self) -> Connection:
        return self.store.engine.connect()

    # -- status -----------------------------------------------------------------------------

    @guarded
    def _lease_end(self) -> Any:
        """When a claim's lease ends: its incarnation's lease while that incarnation runs
        (workers renew the incarnation's row, not each claim's), else the claim's own
        (an ownerless claim's hold)."""
        w, wk = self.t.work, self.t.workers
        owners = (select(wk.c.lease_expires_at)
                  .where(wk.c.incarnation == w.c.incarnation, wk.c.stopped_at.is_(None))
                  .scalar_subquery())
        return case((owners > func.coalesce(w.c.lease_expires_at, 0.0), owners),
                    else_=w.c.lease_expires_at)

    def status(self, dead_limit: int = 20, worker_limit: int = 20) -> Status:
        w, r, c, wk = self.t.work, self.t.schedule_runs, self.t.contexts, self.t.workers
        d = self.store.dialect
        lease_end = self._lease_end().label("lease_end")
        with self._read() as conn:
            now = float(conn.execute(select(d.now())).scalar_one())
            by_state = {str(s): int(n) for s, n in conn.execute(
                select(w.c.state, func.count()).group_by(w.c.state)).all()}
            by_owner = [(str(s), o, int(n)) for s, o, n in conn.execute(
                select(w.c.state, w.c.owner_node, func.count())
                .where(w.c.state.in_(OPEN_STATES))
                .group_by(w.c.state, w.c.owner_node)
                .order_by(w.c.state, w.c.owner_node)).all()]
            oldest = conn.execute(
                select(w.c.work_key, lease_end)
                .where(w.c.state.in_(OPEN_STATES), lease_end.is_not(None))
                .order_by(lease_end).limit(1)).first()
            expired = int(conn.execute(
                select(func.count()).select_from(w)
                .where(w.c.state.in_(OPEN_STATES), self._lease_end() < now)).scalar_one())
            dead = [work_info(x) for x in conn.execute(
                select(w).where(w.c.state == DEAD)
                .order_by(w.c.updated_at.desc()).limit(dead_limit)).all()]
            pending, oldest_claim = conn.execute(
                select(func.count(), func.min(r.c.claimed_at)).where(r.c.state == CLAIMED)
            ).one()
            n_ctx, oldest_ctx = conn.execute(select(func.count(), func.min(c.c.updated_at))
                                             ).one()
            workers = [(x.node, x.incarnation, float(x.heartbeat_at),
                        None if x.stopped_at is None else float(x.stopped_at))
                       for x in conn.execute(select(wk).order_by(wk.c.heartbeat_at.desc())
                                             .limit(worker_limit)).all()]
            conn.rollback()
        return Status(
            now=now, by_state=by_state, by_owner=by_owner,
            oldest_lease=None if oldest is None else (oldest.work_key,
                                                      float(oldest.lease_end)),
            expired_leases=expired, dead=dead, slots_pending=int(pending),
            oldest_pending_slot_claim=None if oldest_claim is None else float(oldest_claim),
            contexts=int(n_ctx), oldest_context=None if oldest_ctx is None else float(oldest_ctx),
            workers=workers,
        )

    # -- work ---------------------------------------------------------------------------------

    @guarded
    def list_work(self, states: Sequence[str] = (), task: str | None = None,
                  owner: str | None = None, limit: int = 50) -> list[WorkInfo]:
        """Work rows, most recently changed first, filtered by state, task name and owner."""
        w = self.t.work
        q = select(w).order_by(w.c.updated_at.desc(), w.c.work_key).limit(limit)
        if states:
            q = q.where(w.c.state.in_(list(states)))
        if task:
            q = q.where(w.c.task_name == task)
        if owner:
            q = q.where(w.c.owner_node == owner)
        with self._read() as conn:
            rows = conn.execute(q).all()
            conn.rollback()
        return [work_info(x) for x in rows]

    @guarded
    def work_detail(self, work_key: str) -> WorkDetail | None:
        w, s, lg = self.t.work, self.t.steps, self.t.ledger
        with self._read() as conn:
            row = conn.execute(select(w).where(w.c.work_key == work_key)).first()
            if row is None:
                conn.rollback()
                return None
            steps = tuple(StepInfo(x.name, int(x.epoch), x.result_json, float(x.created_at))
                          for x in conn.execute(select(s).where(s.c.work_key == work_key)
                                                .order_by(s.c.created_at, s.c.name)).all())
            ledger = tuple(LedgerInfo(x.key, None if x.epoch is None else int(x.epoch),
                                      float(x.applied_at))
                           for x in conn.execute(select(lg.c.key, lg.c.epoch, lg.c.applied_at)
                                                 .where(lg.c.work_key == work_key)
                                                 .order_by(lg.c.applied_at)).all())
            conn.rollback()
        checkpoint = None if row.checkpoint_json is None else CheckpointInfo(
            int(row.checkpoint_epoch), int(row.checkpoint_seq), row.checkpoint_json,
            float(row.checkpoint_at))  # every save and migration 0005 set all four
        return WorkDetail(work_info(row), checkpoint, steps, ledger,
                          _route(row.message_json))

    # -- recovery preview ---------------------------------------------------------------------

    @guarded
    def orphan_candidates(self, limit: int, gone_node: str | None = None) -> list[OrphanCandidate]:
        """What ``Store.claim_orphans`` would take now, without taking it (no lock, no write).

        Open claims whose lease expired, plus (when ``gone_node`` is given) every open claim
        of that node, as a sweep of a new incarnation of that node would take them.
        """
        w = self.t.work
        now = self.store.dialect.now()
        lease_end = self._lease_end()
        expired = lease_end < now
        cond = expired if gone_node is None else or_(expired, w.c.owner_node == gone_node)
        with self._read() as conn:
            rows = conn.execute(
                select(w.c.work_key, w.c.task_name, w.c.task_id, w.c.state, w.c.owner_node,
                       lease_end.label("lease_expires_at"), w.c.deaths,
                       w.c.message_json.is_not(None).label("has_message"),
                       expired.label("expired"))
                .where(w.c.state.in_(OPEN_STATES), cond)
                .order_by(w.c.created_at)
                .limit(limit)
            ).all()
            conn.rollback()
        return [OrphanCandidate(
            x.work_key, x.task_name, x.task_id, x.state, x.owner_node,
            None if x.lease_expires_at is None else float(x.lease_expires_at), int(x.deaths),
            bool(x.has_message), "lease_expired" if x.expired else "node_gone",
        ) for x in rows]

    # -- schedule -----------------------------------------------------------------------------

    @guarded
    def schedule(self, prefix: str = "") -> list[EntrySlots]:
        """Every beat marker (entries whose key starts with ``prefix``) with slot counts."""
        m, r = self.t.schedule_markers, self.t.schedule_runs
        runs = (select(
            r.c.entry,
            func.sum(_when(r.c.state.in_(("sent", "started")))).label("sent"),
            func.sum(_when(r.c.state == "skipped")).label("skipped"),
            func.sum(_when(r.c.state == CLAIMED)).label("pending"),
            func.min(_value_when(r.c.state == CLAIMED, r.c.claimed_at)).label("oldest_claim"),
            func.max(_value_when(r.c.state.in_(("sent", "started")), r.c.slot))
            .label("last_sent"),
        ).group_by(r.c.entry).subquery())
        q = (select(m.c.entry, m.c.last_slot, m.c.definition_json, m.c.updated_at,
                    runs.c.sent, runs.c.skipped, runs.c.pending, runs.c.oldest_claim,
                    runs.c.last_sent)
             .select_from(m.outerjoin(runs, runs.c.entry == m.c.entry))
             .order_by(m.c.entry))
        if prefix:
            q = q.where(m.c.entry.startswith(prefix, autoescape=True))
        with self._read() as conn:
            rows = conn.execute(q).all()
            conn.rollback()
        return [EntrySlots(
            x.entry, float(x.last_slot), x.definition_json, float(x.updated_at),
            int(x.sent or 0), int(x.skipped or 0), int(x.pending or 0),
            None if x.oldest_claim is None else float(x.oldest_claim),
            None if x.last_sent is None else float(x.last_sent),
        ) for x in rows]

    # -- retention ----------------------------------------------------------------------------

    @guarded
    def prune_counts(self, older_than: float, ledger: bool = False) -> PruneCounts:
        """How many rows :meth:`prune` would delete now (nothing is changed)."""
        t = self.t
        w, s, lg, rv = t.work, t.steps, t.ledger, t.revocations
        with self._read() as conn:
            cutoff = float(conn.execute(select(self.store.dialect.now())).scalar_one()) \
                - older_than
            keys = select(w.c.work_key).where(finished_before(t, cutoff))
            counts = PruneCounts(
                work=_count(conn, select(func.count()).select_from(w)
                            .where(finished_before(t, cutoff))),
                checkpoints=_count(conn, select(func.count()).select_from(w).where(
                    finished_before(t, cutoff), w.c.checkpoint_json.is_not(None))),
                steps=_count(conn, select(func.count()).select_from(s)
                             .where(s.c.work_key.in_(keys))),
                ledger=_count(conn, select(func.count()).select_from(lg)
                              .where(ledger_before(t, cutoff))) if ledger else 0,
                revocations=_count(conn, select(func.count()).select_from(rv)
                                   .where(revocations_before(t, cutoff))),
            )
            conn.rollback()
        return counts

    def prune(self, older_than: float, ledger: bool = False,
              batch: int = PRUNE_BATCH) -> PruneCounts:
        """Delete ended work finished more than ``older_than`` seconds ago with its
        checkpoint and steps, revocation tombstones as old, and, only with ``ledger``,
        ledger markers as old (a deleted marker no longer guards its effect).

        The cutoff is taken once from the database's clock; each batch is one transaction
        (:mod:`.retention`, the same deletes the worker's automatic retention runs).
        """
        cutoff = self.store.now() - older_than
        n_work = n_cp = n_steps = n_ledger = n_rv = 0
        while True:
            done = delete_finished_work(self.store, cutoff, batch)
            n_work, n_cp, n_steps = (n_work + done.work, n_cp + done.checkpoints,
                                     n_steps + done.steps)
            if done.work < batch:
                break
        while ledger:
            n = delete_ledger_markers(self.store, cutoff, batch)
            n_ledger += n
            if n < batch:
                break
        while True:
            n = delete_revocations(self.store, cutoff, batch)
            n_rv += n
            if n < batch:
                break
        return PruneCounts(n_work, n_cp, n_steps, n_ledger, n_rv)


def _when(cond: Any) -> Any:
    return case((cond, 1), else_=0)


def _value_when(cond: Any, value: Any) -> Any:
    return case((cond, value), else_=None)


def _count(conn: Connection, q: Any) -> int:
    return int(conn.execute(q).scalar_one())


def _route(message_json: str | None) -> tuple[str, str] | None:
    if message_json is None:
        return None
    try:
        m = json.loads(message_json)
    except ValueError:
        return ("?", "?")
    return (str(m.get("exchange") or ""), str(m.get("routing_key") or ""))


__all__ = ["FINISHED_STATES", "AdminQueries", "EntrySlots", "OrphanCandidate", "PruneCounts",
           "Status", "WorkDetail"]
