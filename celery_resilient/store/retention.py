"""Retention: what the store no longer needs, deleted in bounded batches.

Each ``delete_*`` function deletes at most ``batch`` rows of one table (finished work with its
checkpoint and steps counts as one) in one short transaction, and returns what it deleted:
a batch that comes back full means there may be more. The rows are chosen by an indexed
predicate (``finished_at``, ``applied_at``, ``created_at``, ``heartbeat_at``, ``claimed_at``,
``updated_at``) ordered by that column, so a batch reads an index range and never scans the
table; ``FOR UPDATE SKIP LOCKED`` on PostgreSQL lets two pruners (two workers, or a worker and
``celery resilient prune``) take disjoint batches instead of waiting on each other.

Cutoffs are absolute times on the database's clock (``Store.now() - retention``), bound as
parameters: ``clock_timestamp()`` in a predicate is volatile and would defeat the index.

What is never deleted: open work (reserved, running, requeued), a checkpoint or step of work
that is not deleted in the same statement, a ledger marker whose work is open, a revocation
tombstone whose task id has open work, the row of a worker incarnation that has not ended
(or still owns open work), a beat slot that is still only claimed.

The worker's maintainer runs these every ``resilient_prune_interval``
(:mod:`celery_resilient.worker.maintainer`); ``celery resilient prune``
(:mod:`.admin_queries`, :mod:`.operator_queries`) loops over the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, exists, func, select, tuple_

from celery_resilient.core import killpoints
from celery_resilient.core.states import OPEN_STATES, SENT, SKIPPED, STARTED, TERMINAL_STATES
from celery_resilient.store import checkpoint_compat
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.schema import Tables

#: Rows deleted per table per transaction, unless told otherwise.
PRUNE_BATCH = 500
FINISHED_STATES = TERMINAL_STATES
#: Beat slot records that are history (a claimed slot may still be sent).
ENDED_SLOT_STATES = (SENT, STARTED, SKIPPED)


# -- predicates (shared with the operator's counts) ---------------------------------------------

def finished_before(t: Tables, cutoff: float) -> Any:
    """Ended work (every terminal state) that finished before ``cutoff``.

    Every transition to a terminal state sets ``finished_at``, and every transition out of
    one clears it, so this reads the ``finished_at`` index and open work never matches.
    """
    w = t.work
    return and_(w.c.finished_at < cutoff, w.c.state.in_(FINISHED_STATES))


def ledger_before(t: Tables, cutoff: float) -> Any:
    """Ledger markers applied before ``cutoff`` whose work (if any) is no longer open."""
    lg, w = t.ledger, t.work
    still_open = exists().where(w.c.work_key == lg.c.work_key, w.c.state.in_(OPEN_STATES))
    return and_(lg.c.applied_at < cutoff, ~still_open)


def revocations_before(t: Tables, cutoff: float) -> Any:
    """Revocation tombstones recorded before ``cutoff`` whose task id has no open work:
    the open work of a revoked id (running, its owner alive) still needs its tombstone
    so that a takeover ends it instead of running it again."""
    rv, w = t.revocations, t.work
    still_open = exists().where(w.c.task_id == rv.c.task_id, w.c.state.in_(OPEN_STATES))
    return and_(rv.c.created_at < cutoff, ~still_open)


def workers_gone_before(t: Tables, cutoff: float, lease_seconds: float) -> Any:
    """``workers`` rows of incarnations that ended before ``cutoff`` and own no open work.

    Ended: stopped (a warm shutdown, or declared dead by a successor) before the cutoff, or
    never stopped but its lease ran out before the cutoff (killed; no successor came). A live
    worker renews its lease every heartbeat, so its row never matches; nor does one whose
    incarnation still owns open work, which the sweeper judges by that row. Each branch
    reads an index (``stopped_at``; ``heartbeat_at``, before the lease end).
    """
    wk, w = t.workers, t.work
    lease_end = func.coalesce(wk.c.lease_expires_at, wk.c.heartbeat_at + lease_seconds)
    owns_open = select(w.c.work_key).where(w.c.incarnation == wk.c.incarnation,
                                           w.c.state.in_(OPEN_STATES)).exists()
    ended = ((wk.c.stopped_at.is_not(None) & (wk.c.stopped_at < cutoff))
             | (wk.c.stopped_at.is_(None) & (wk.c.heartbeat_at < cutoff)
                & (lease_end < cutoff)))
    return ended & ~owns_open


def beat_runs_before(t: Tables, cutoff: float) -> Any:
    """Sent, started and skipped beat slot records claimed before ``cutoff``."""
    r = t.schedule_runs
    return and_(r.c.claimed_at < cutoff, r.c.state.in_(ENDED_SLOT_STATES))


# -- one batch per call ---------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkPruned:
    """What one batch of :func:`delete_finished_work` deleted."""

    work: int = 0
    checkpoints: int = 0
    steps: int = 0


@guarded
def delete_finished_work(store: Database, cutoff: float, batch: int = PRUNE_BATCH) -> WorkPruned:
    """Delete up to ``batch`` ended work rows finished before ``cutoff`` (each with its
    checkpoint) and their steps, in one transaction. Only the keys whose work row this
    statement deleted lose their steps."""
    t = store.t
    w, s = t.work, t.steps
    chosen = (select(w.c.work_key).where(finished_before(t, cutoff))
              .order_by(w.c.finished_at).limit(batch)
              .with_for_update(**store.dialect.lock_kwargs()))
    with store.begin() as conn:
        which = and_(w.c.work_key.in_(store.dialect.chosen(conn, chosen)),
                     w.c.state.in_(FINISHED_STATES))
        doomed = delete(w).where(which)
        # checkpoint_seq > 0 exactly when the row holds a checkpoint; not an IS NOT
        # NULL expression, which SQLite 3.40's DELETE ... RETURNING gives as true for all.
        if store.dialect.is_mysql:  # no DELETE ... RETURNING: read the locked rows first
            gone = conn.execute(select(w.c.work_key, w.c.checkpoint_seq)
                                .where(which)).all()
            conn.execute(doomed)
        else:
            gone = conn.execute(doomed.returning(w.c.work_key, w.c.checkpoint_seq)).all()
        if not gone:
            return WorkPruned()
        keys = [str(k) for k, _ in gone]
        n_cp = sum(1 for _, seq in gone if seq)  # the checkpoint went with its work row
        if killpoints.ARMED:
            killpoints.reached("mid_prune")
        n_steps = conn.execute(delete(s).where(s.c.work_key.in_(keys))).rowcount
        # what the previous version would resume
        checkpoint_compat.delete_old_checkpoints(store.t, conn, keys)
    return WorkPruned(len(keys), int(n_cp), int(n_steps))


def _delete_oldest(store: Database, key: Any, order: Any, where: Any, batch: int) -> int:
    """Delete the ``batch`` rows matching ``where`` first in ``order``, by primary ``key``."""
    chosen = (select(key).where(where).order_by(order).limit(batch)
              .with_for_update(**store.dialect.lock_kwargs()))
    with store.begin() as conn:
        # No second look at ``where`` here: on PostgreSQL a row changed after this statement
        # began is locked in its new version and the choice's predicate checked again on it
        # (or skipped while its writer holds it); SQLite runs one writer at a time.
        return int(conn.execute(delete(key.table).where(
            key.in_(store.dialect.chosen(conn, chosen)))).rowcount)


@guarded
def delete_ledger_markers(store: Database, cutoff: float, batch: int = PRUNE_BATCH) -> int:
    """Delete up to ``batch`` ledger markers applied before ``cutoff`` (see
    :func:`ledger_before`). A deleted marker no longer stops its effect being applied again."""
    lg = store.t.ledger
    return _delete_oldest(store, lg.c.key, lg.c.applied_at, ledger_before(store.t, cutoff),
                          batch)


@guarded
def delete_revocations(store: Database, cutoff: float, batch: int = PRUNE_BATCH) -> int:
    """Delete up to ``batch`` revocation tombstones (see :func:`revocations_before`)."""
    rv = store.t.revocations
    return _delete_oldest(store, rv.c.task_id, rv.c.created_at,
                          revocations_before(store.t, cutoff), batch)


@guarded
def delete_ended_workers(store: Database, cutoff: float, lease_seconds: float,
                         batch: int = PRUNE_BATCH) -> int:
    """Delete up to ``batch`` rows of worker incarnations that ended before ``cutoff``
    (see :func:`workers_gone_before`); never a live one."""
    wk = store.t.workers
    return _delete_oldest(store, wk.c.incarnation, wk.c.heartbeat_at,
                          workers_gone_before(store.t, cutoff, lease_seconds), batch)


@guarded
def delete_beat_runs(store: Database, cutoff: float, batch: int = PRUNE_BATCH) -> int:
    """Delete up to ``batch`` sent, started or skipped beat slot records claimed before
    ``cutoff``; a slot that is only claimed stays (its beat may still send it)."""
    t = store.t
    r = t.schedule_runs
    chosen = (select(r.c.entry, r.c.slot).where(beat_runs_before(t, cutoff))
              .order_by(r.c.claimed_at).limit(batch)
              .with_for_update(**store.dialect.lock_kwargs()))
    with store.begin() as conn:
        return int(conn.execute(delete(r).where(
            tuple_(r.c.entry, r.c.slot).in_(store.dialect.chosen(conn, chosen)),
            r.c.state.in_(ENDED_SLOT_STATES))).rowcount)


@guarded
def delete_contexts(store: Database, cutoff: float, batch: int = PRUNE_BATCH) -> list[str]:
    """Delete up to ``batch`` continuity contexts not written since ``cutoff``; their keys
    (a cache in front of the store must forget them)."""
    c = store.t.contexts
    chosen = (select(c.c.key).where(c.c.updated_at < cutoff)
              .order_by(c.c.updated_at).limit(batch)
              .with_for_update(**store.dialect.lock_kwargs()))
    with store.begin() as conn:
        if store.dialect.is_mysql:  # no DELETE ... RETURNING: the locked choice is the list
            keys = store.dialect.chosen(conn, chosen)
            conn.execute(delete(c).where(c.c.key.in_(keys)))
            return [str(k) for k in keys]
        return [str(k) for k in conn.execute(
            delete(c).where(c.c.key.in_(chosen), c.c.updated_at < cutoff)
            .returning(c.c.key)).scalars()]


__all__ = ["ENDED_SLOT_STATES", "FINISHED_STATES", "PRUNE_BATCH", "WorkPruned",
           "beat_runs_before", "delete_beat_runs", "delete_contexts", "delete_ended_workers",
           "delete_finished_work", "delete_ledger_markers", "delete_revocations",
           "finished_before", "ledger_before", "revocations_before", "workers_gone_before"]
