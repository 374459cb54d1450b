"""The operator's transitions on stored work: cancel, retry and forget.

``celery -A proj resilient cancel|retry|forget`` and the Django admin's actions run these
(through :mod:`celery_resilient.ops.operations`, which publishes what ``retry`` re-queues). Work
is selected by key, by a filter (states, task name, age), or both: a named key must also
match the filter. Each batch is one transaction that locks its rows and checks every row's
state again under the lock, so a take, finish or sweep that commits first is never
overwritten: the row is refused with the reason instead. ``dry_run`` runs the same
selection and checks on a read-only connection, so it lists exactly what would change.

* ``cancel``: open work (reserved, running, requeued) becomes ``cancelled``. A running
  execution is not interrupted: its next fenced write (checkpoint, step, ledger, result)
  matches no row, and the store raises ``WorkStopped`` because the row was cancelled at the
  epoch it holds.
* ``retry``: ended work except ``done`` becomes ``requeued`` with its death and re-publish
  counts reset, error and finish time cleared, and the revocation tombstone of its task id
  deleted (or the take would end it ``revoked`` again). The caller sends the stored message
  after each batch commits; until a worker takes it, the sweeper re-sends it when its lease
  of ``hold_seconds`` runs out.
* ``forget``: ended work is deleted with its checkpoint and steps. Ledger markers are kept:
  they are what keeps an applied effect from being applied again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, and_, delete, func, select, update

from celery_resilient.core.states import (
    ALL_STATES,
    CANCELLED,
    DEAD,
    DONE,
    ENDED_BY_REQUEST,
    FAILED,
    OPEN_STATES,
    REQUEUED,
    RUNNING,
    TERMINAL_STATES,
)
from celery_resilient.errors import ResilientError
from celery_resilient.store import checkpoint_compat
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.retention import delete_ended_workers, workers_gone_before

BATCH = 500
CANCEL_SOURCES = OPEN_STATES
#: ``done`` is terminal but never retried: its stored result already answers every copy.
RETRY_SOURCES = tuple(s for s in TERMINAL_STATES if s != DONE)
FORGET_SOURCES = TERMINAL_STATES
SOURCES = {"cancel": CANCEL_SOURCES, "retry": RETRY_SOURCES, "forget": FORGET_SOURCES}
CANCELLED_BY_OPERATOR = "cancelled by operator"


class SelectionError(ResilientError):
    """The operator's selection of work is empty or names states the action cannot change."""


@dataclass(frozen=True)
class Selection:
    """Which work an operator action is for: named keys, a filter, or both (a named key must
    also match the filter). ``older_than`` is seconds since the work finished (open work:
    since it last changed), by the database's clock."""

    keys: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    task: str | None = None
    older_than: float | None = None

    @property
    def has_filter(self) -> bool:
        return bool(self.states or self.task or self.older_than is not None)

    def describe(self) -> str:
        """The filter in words, for prompts and refusals."""
        parts = []
        if self.states:
            parts.append("state " + "/".join(self.states))
        if self.task:
            parts.append(f"task {self.task}")
        if self.older_than is not None:
            parts.append(f"finished or last changed more than {self.older_than:g}s ago")
        return ", ".join(parts) or "no filter"

    def checked(self, action: str) -> Selection:
        """This selection, its states defaulting to what ``action`` can change.

        An empty selection is refused (an action never means "all work"), and so is a state
        the action cannot change: a filter silently matching nothing would hide a typo.
        """
        sources = SOURCES[action]
        keys = tuple(dict.fromkeys(k for k in self.keys if k))
        if not keys and not self.has_filter:
            raise SelectionError(f"{action}: name work keys or give a filter (state, task, "
                                 "older than); an action never applies to all work at once")
        unknown = [s for s in self.states if s not in ALL_STATES]
        if unknown:
            raise SelectionError(f"unknown state(s) {', '.join(unknown)}; states are "
                                 f"{', '.join(ALL_STATES)}")
        wrong = [s for s in self.states if s not in sources]
        if wrong:
            raise SelectionError(f"{action} applies to work in {', '.join(sources)}; not to "
                                 f"{', '.join(wrong)}")
        if self.older_than is not None and self.older_than <= 0:
            raise SelectionError("older than must be a positive number of seconds")
        return Selection(keys, tuple(dict.fromkeys(self.states)) or sources, self.task,
                         self.older_than)


@dataclass(frozen=True)
class Target:
    """One unit of work an action changed (or, in a dry run, would change)."""

    work_key: str
    task_name: str
    task_id: str
    previous_state: str
    owner_node: str | None
    message_json: str | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Refusal:
    """One unit of work an action did not change, and why (``state`` None: no such work)."""

    work_key: str
    state: str | None
    reason: str


@dataclass(frozen=True)
class ActionReport:
    """What an operator action did, or (``dry_run``) would do.

    ``checkpoints`` and ``steps`` count the rows ``forget`` deleted with the work. ``unsent``
    lists retried work whose message could not be published: (work key, error).
    """

    action: str
    dry_run: bool
    changed: tuple[Target, ...] = ()
    refused: tuple[Refusal, ...] = ()
    checkpoints: int = 0
    steps: int = 0
    unsent: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        """Nothing refused and every retried message sent."""
        return not self.refused and not self.unsent


def refusal(action: str, state: str, has_message: bool) -> str | None:
    """Why ``action`` must not change work in ``state``, or None when it may."""
    if action == "cancel" and state not in CANCEL_SOURCES:
        return (f"it already ended ({state}); only open work (reserved, running, requeued) "
                "can be cancelled")
    if action == "retry":
        if state == DONE:
            return ("it is done: its result is stored and every copy returns it; send a new "
                    "task to run it again")
        if state in OPEN_STATES:
            return (f"it is still open ({state}): it is queued or running already; re-publish "
                    "stuck work with `resilient recover` or the admin's re-publish action")
        if not has_message:
            return ("no broker message is stored for it (it was never received by a worker "
                    "nor submitted durably), so there is nothing to send again")
    if action == "forget" and state not in FORGET_SOURCES:
        return (f"it is still open ({state}); only ended work can be forgotten (cancel it "
                "first)")
    return None


_Act = Callable[[Connection, list[Any]], list[Target]]


class RepublishRefused(ResilientError):
    """This work cannot be re-published."""


@dataclass(frozen=True)
class Republished:
    """What ``republish`` did: the work's key, task id, and state and owner before it."""

    work_key: str
    task_id: str
    previous_state: str
    previous_owner: str | None
    deaths_reset: bool


def republish_refusal(state: str, lease_left: float | None, owner: str | None,
            error: str | None, has_message: bool) -> str | None:
    """Why work in this state must not be re-published, or None when it may be.

    ``lease_left`` is seconds until the lease expires by the database's clock (negative when
    it has expired, None when there is none).
    """
    if state == DONE:
        return ("it is already done: its result is stored, and a re-published copy would only "
                "return that result")
    if state == FAILED:
        return (f"it failed by its own exception ({error or 'no error recorded'}); a copy with "
                "the same task id is skipped as a duplicate: use retry to run this request "
                "again, or send a new task")
    if state in ENDED_BY_REQUEST:
        return (f"it ended as {state} ({error or 'no reason recorded'}); a copy with the same "
                "task id is stopped: use retry to run this request again, or send a new task")
    if state == RUNNING and lease_left is not None and lease_left > 0:
        return (f"it is running on {owner or 'an unknown worker'} under a live lease "
                f"({lease_left:.0f}s left); it is not stuck. If that worker is gone, its lease "
                "runs out and the recovery sweep re-publishes it")
    if not has_message:
        return ("no broker message is stored for it (it was never received by a worker nor "
                "submitted durably), so there is nothing to re-send")
    return None


class OperatorQueries:
    """Cancel, retry and forget on a store's plumbing (:mod:`.db`), in batches."""

    def __init__(self, store: Database, batch: int = BATCH) -> None:
        self.store = store
        self.t = store.t
        self.batch = batch

    # -- the actions ------------------------------------------------------------------------

    @guarded
    def requeue_for_republish(self, work_key: str, hold_seconds: float) -> Target:
        """Requeue dead or stuck work for an operator's re-publish, under a row lock, or
        raise :class:`RepublishRefused` with the reason; the caller publishes its message.

        Dead work gets its death count reset, so the copy runs instead of being parked
        again; its attempts keep counting. A running claim whose lease expired counts one
        more death, as the recovery sweep counts it. The lease of ``hold_seconds`` keeps the
        sweeper off it while the message is sent, and makes it send it if that fails.
        """
        store = self.store
        w = store.t.work
        now = store.dialect.now()
        with store.begin() as conn:
            row = conn.execute(
                select(w.c.task_name, w.c.task_id, w.c.state, w.c.owner_node, w.c.error,
                       w.c.deaths, w.c.message_json,
                       (w.c.lease_expires_at - now).label("lease_left"))
                .where(w.c.work_key == work_key)
                .with_for_update()
            ).first()
            if row is None:
                raise RepublishRefused(
                    f"cannot re-publish {work_key!r}: no such work in the store")
            why = republish_refusal(row.state, row.lease_left, row.owner_node, row.error,
                                    row.message_json is not None)
            if why is not None:
                raise RepublishRefused(f"cannot re-publish {work_key!r}: {why}")
            dead = row.state == DEAD
            deaths = 0 if dead else row.deaths + (1 if row.state == RUNNING else 0)
            conn.execute(update(w).where(w.c.work_key == work_key).values(
                state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
                lease_expires_at=now + hold_seconds, republished=w.c.republished + 1,
                deaths=deaths, error=None if dead else w.c.error, finished_at=None,
                updated_at=now,
            ))
        return Target(work_key, row.task_name, row.task_id, row.state, row.owner_node,
                      row.message_json)

    def cancel(self, selection: Selection, reason: str | None = None,
               dry_run: bool = False) -> ActionReport:
        """Open work -> ``cancelled``; a running execution stops at its next fenced write."""
        w = self.t.work
        error = CANCELLED_BY_OPERATOR + (f": {reason.strip()}" if reason and reason.strip()
                                         else "")

        def act(conn: Connection, rows: list[Any]) -> list[Target]:
            keys = [r.work_key for r in rows]
            conn.execute(update(w).where(w.c.work_key.in_(keys), w.c.state.in_(OPEN_STATES))
                         .values(**self.store.ended(CANCELLED, error)))
            return [_target(r) for r in rows]

        return self._apply("cancel", selection, dry_run, act)

    @guarded
    def retry(self, selection: Selection, hold_seconds: float, dry_run: bool = False,
              rewrite: Callable[[str], str] | None = None,
              on_batch: Callable[[Sequence[Target]], None] | None = None) -> ActionReport:
        """Ended work (not done) -> ``requeued``, counters reset, revocation tombstone gone.

        ``rewrite`` turns the stored message into the one to send; it is stored in its place,
        so the sweeper re-sends that same message if this one is lost. ``on_batch`` is called
        with the requeued work after each batch commits (to publish it).
        """
        w, rv = self.t.work, self.t.revocations
        now = self.store.dialect.now()

        def act(conn: Connection, rows: list[Any]) -> list[Target]:
            done: list[Target] = []
            for r in rows:
                message = rewrite(r.message_json) if rewrite else r.message_json
                conn.execute(update(w).where(
                    w.c.work_key == r.work_key, w.c.state.in_(RETRY_SOURCES)).values(
                    state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
                    lease_expires_at=now + hold_seconds, deaths=0, republished=0,
                    error=None, result_json=None, finished_at=None, message_json=message,
                    updated_at=now))
                done.append(_target(r, message))
            conn.execute(delete(rv).where(rv.c.task_id.in_(sorted({r.task_id for r in rows}))))
            return done

        return self._apply("retry", selection, dry_run, act, on_batch)

    @guarded
    def forget(self, selection: Selection, dry_run: bool = False) -> ActionReport:
        """Delete ended work (its checkpoint with it) and its steps; its ledger markers stay."""
        w, s = self.t.work, self.t.steps
        counts = {"checkpoints": 0, "steps": 0}

        def count(conn: Connection, keys: list[str]) -> None:
            counts["checkpoints"] += int(conn.execute(  # each goes with its work row
                select(func.count()).select_from(w).where(
                    w.c.work_key.in_(keys), w.c.checkpoint_json.is_not(None))).scalar_one())
            counts["steps"] += int(conn.execute(select(func.count()).select_from(s).where(
                s.c.work_key.in_(keys))).scalar_one())

        def act(conn: Connection, rows: list[Any]) -> list[Target]:
            keys = [r.work_key for r in rows]
            # Remember each key's last epoch: its next row continues from there, so an
            # execution of the forgotten work can never write into new work of the same key.
            fg = self.t.forgotten
            at = float(conn.execute(select(self.store.dialect.now())).scalar_one())
            ins = self.store.dialect.insert(fg)
            conn.execute(ins.on_conflict_do_update(
                index_elements=[fg.c.work_key],
                set_={"epoch": ins.excluded.epoch, "forgotten_at": ins.excluded.forgotten_at}),
                [{"work_key": k, "epoch": e, "forgotten_at": at} for k, e in
                 conn.execute(select(w.c.work_key, w.c.epoch).where(w.c.work_key.in_(keys)))])
            # what the previous version reads
            checkpoint_compat.delete_old_checkpoints(self.store.t, conn, keys)
            counts["steps"] += conn.execute(delete(s).where(s.c.work_key.in_(keys))).rowcount
            which = and_(w.c.work_key.in_(keys), w.c.state.in_(FORGET_SOURCES))
            doomed = delete(w).where(which)
            if self.store.dialect.is_mysql:  # no DELETE ... RETURNING; the rows are locked
                gone = conn.execute(select(w.c.checkpoint_seq).where(which)).all()
                conn.execute(doomed)
            else:
                gone = conn.execute(doomed.returning(w.c.checkpoint_seq)).all()
            # each checkpoint goes with its work row (checkpoint_seq > 0: see retention)
            counts["checkpoints"] += sum(1 for (seq,) in gone if seq)
            return [_target(r) for r in rows]

        def preview(conn: Connection, rows: list[Any]) -> list[Target]:
            count(conn, [r.work_key for r in rows])
            return [_target(r) for r in rows]

        report = self._apply("forget", selection, dry_run, act, preview=preview)
        return ActionReport(report.action, report.dry_run, report.changed, report.refused,
                            int(counts["checkpoints"]), int(counts["steps"]))

    # -- selection --------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, dry_run: bool) -> Iterator[Connection]:
        if not dry_run:
            with self.store.begin() as conn:
                yield conn
            return
        with self.store.engine.connect() as conn:
            try:
                yield conn
            finally:
                conn.rollback()

    def _apply(self, action: str, selection: Selection, dry_run: bool, act: _Act,
               on_batch: Callable[[Sequence[Target]], None] | None = None,
               preview: _Act | None = None) -> ActionReport:
        """Select in batches (locked unless ``dry_run``), refuse what may not change, and
        ``act`` on the rest inside the same transaction. A dry run writes nothing: it calls
        ``preview`` (if given) instead of ``act``.

        Named keys are read as named (a missing one is refused); a filter is read in key
        order, each batch after the last key of the one before, so rows refused while still
        matching are never read twice.
        """
        sel = selection.checked(action)
        cutoff = None if sel.older_than is None else self.store.now() - sel.older_than
        changed: list[Target] = []
        refused: list[Refusal] = []
        after: str | None = None
        chunks = [sel.keys[i:i + self.batch] for i in range(0, len(sel.keys), self.batch)]
        while True:
            with self._transaction(dry_run) as conn:
                if sel.keys:
                    rows = self._read_keys(conn, chunks.pop(0), not dry_run)
                else:
                    rows = self._read_filter(conn, sel, cutoff, after, not dry_run)
                eligible: list[Any] = []
                for key, row in rows:
                    why = self._why_not(action, sel, cutoff, row)
                    if why is None:
                        eligible.append(row)
                    else:
                        refused.append(Refusal(key, None if row is None else row.state, why))
                if not eligible:
                    done: list[Target] = []
                elif dry_run:
                    done = preview(conn, eligible) if preview else [_target(r) for r in eligible]
                else:
                    done = act(conn, eligible)
            changed.extend(done)
            if done and on_batch is not None and not dry_run:
                on_batch(done)
            if sel.keys:
                if not chunks:
                    break
            elif len(rows) < self.batch:
                break
            else:
                after = rows[-1][0]
        return ActionReport(action, dry_run, tuple(changed), tuple(refused))

    def _columns(self) -> tuple[Any, ...]:
        w = self.t.work
        return (w.c.work_key, w.c.task_name, w.c.task_id, w.c.state, w.c.owner_node,
                w.c.message_json, w.c.updated_at, w.c.finished_at)

    def _read_keys(self, conn: Connection, keys: Sequence[str],
                   lock: bool) -> list[tuple[str, Any]]:
        w = self.t.work
        q = select(*self._columns()).where(w.c.work_key.in_(list(keys)))
        found = {r.work_key: r for r in conn.execute(q.with_for_update() if lock else q)}
        return [(k, found.get(k)) for k in keys]

    def _read_filter(self, conn: Connection, sel: Selection, cutoff: float | None,
                     after: str | None, lock: bool) -> list[tuple[str, Any]]:
        w = self.t.work
        q = select(*self._columns()).where(w.c.state.in_(sel.states))
        if sel.task:
            q = q.where(w.c.task_name == sel.task)
        if cutoff is not None:
            q = q.where(func.coalesce(w.c.finished_at, w.c.updated_at) < cutoff)
        if after is not None:
            q = q.where(w.c.work_key > after)
        q = q.order_by(w.c.work_key).limit(self.batch)
        return [(str(r.work_key), r) for r in conn.execute(q.with_for_update() if lock else q)]

    @staticmethod
    def _why_not(action: str, sel: Selection, cutoff: float | None, row: Any) -> str | None:
        if row is None:
            return "no such work in the store"
        why = refusal(action, row.state, row.message_json is not None)
        if why is not None:
            return why
        if not _matches(sel, cutoff, row):
            return f"it does not match the filter ({sel.describe()}): it is {row.state}"
        return None


def _matches(sel: Selection, cutoff: float | None, row: Any) -> bool:
    if row.state not in sel.states:
        return False
    if sel.task and row.task_name != sel.task:
        return False
    if cutoff is not None:
        at = row.finished_at if row.finished_at is not None else row.updated_at
        return bool(at < cutoff)
    return True


def _target(row: Any, message_json: str | None = None) -> Target:
    return Target(str(row.work_key), str(row.task_name), str(row.task_id), str(row.state),
                  row.owner_node, message_json)


__all__ = ["CANCELLED_BY_OPERATOR", "CANCEL_SOURCES", "FORGET_SOURCES", "RETRY_SOURCES",
           "ActionReport", "OperatorQueries", "Refusal", "RepublishRefused", "Republished",
           "Selection", "SelectionError", "Target", "refusal", "republish_refusal"]


# -- pruning the workers table ------------------------------------------------------------------

@guarded
def prune_workers_count(store: Database, older_than: float, lease_seconds: float) -> int:
    """How many ``workers`` rows :func:`prune_workers` would delete now."""
    wk = store.t.workers
    with store.engine.connect() as conn:
        cutoff = float(conn.execute(select(store.dialect.now())).scalar_one()) - older_than
        n = conn.execute(select(func.count()).select_from(wk)
                         .where(workers_gone_before(store.t, cutoff, lease_seconds))
                         ).scalar_one()
        conn.rollback()
    return int(n)


def prune_workers(store: Database, older_than: float, lease_seconds: float,
                  batch: int = BATCH) -> int:
    """Delete the ``workers`` rows of incarnations that ended more than ``older_than``
    seconds ago (see :func:`.retention.workers_gone_before`); never a live one. One worker
    start adds one row, so without this the table grows by a row per restart. Batched, one
    short transaction each (:func:`.retention.delete_ended_workers`); the cutoff comes once
    from the database's clock."""
    cutoff = store.now() - older_than
    deleted = 0
    while True:
        n = delete_ended_workers(store, cutoff, lease_seconds, batch)
        deleted += n
        if n < batch:
            return deleted
