"""``Store``: the facade the rest of the library calls (claims and takes, incarnations and
liveness proofs, sweeps, reads, checkpoints, steps and the ledger), on the plumbing of
:mod:`.db`. Callers see the plain records of :mod:`.records`, never SQL. The other query
modules (schedule, contexts, retention, operator and admin queries) build on :mod:`.db`
alone."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Row,
    and_,
    case,
    delete,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from celery_resilient.core.identity import EAGER_SUFFIX, Owner
from celery_resilient.core.states import (
    DEAD,
    DONE,
    ENDED_BY_REQUEST,
    EXPIRED,
    FAILED,
    OPEN_STATES,
    REQUEUED,
    RESERVED,
    REVOKED,
    RUNNING,
    STOPPED_STATES,
    UNSTARTED_PID,
)
from celery_resilient.errors import (
    StoreUnavailable,
    WorkKeyConflict,
)
from celery_resilient.store import liveness
from celery_resilient.store.batched_takes import BatchedTakes, Finish, Started, TakeRequest
from celery_resilient.store.checkpoint_compat import (
    RowView,
    checkpoint_to_resume,
    delete_old_checkpoints,
)
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.records import (
    ENDED_PROCESS,
    ENDED_SESSION,
    ENDED_STOP,
    ENDED_SUCCESSOR,
    PROVEN_DEAD,
    SESSION_ALIVE,
    UNJUDGED,
    Claim,
    Ended,
    GoneIncarnations,
    IncarnationRow,
    Orphan,
    Receipt,
    Resume,
    TakeOutcome,
    WorkInfo,
    work_info,
)

log = logging.getLogger(__name__)
REVOKE_LIST_ERROR = "revoked by task id (Celery's revoke list)"
#: A work row's checkpoint columns once it is cleared: the next save is #1 again.
NO_CHECKPOINT: dict[str, Any] = {"checkpoint_json": None, "checkpoint_seq": 0,
                                 "checkpoint_epoch": None, "checkpoint_at": None}
#: What callers import from here (the facade), defined in the modules below it
__all__ = [
    "ENDED_PROCESS", "ENDED_SESSION", "ENDED_STOP", "ENDED_SUCCESSOR", "NO_CHECKPOINT",
    "PROVEN_DEAD", "REVOKE_LIST_ERROR", "SESSION_ALIVE", "UNJUDGED", "Claim", "Ended",
    "GoneIncarnations", "IncarnationRow", "Orphan", "Receipt", "Resume", "Store",
    "TakeOutcome", "WorkInfo", "guarded", "work_info",
]


class Store(Database):
    """The durable store: claims, checkpoints, steps, ledger, contexts, schedule records."""

    def __init__(self, url: str, table_prefix: str = "resilient_") -> None:
        super().__init__(url, table_prefix)
        self._batched = BatchedTakes(self.t, self.dialect)

    # -- claims -----------------------------------------------------------------------------

    def record_receipt(
        self, work_key: str, task_name: str, task_id: str, args_digest: str | None,
        message_json: str | None, owner: Owner, lease_seconds: float,
    ) -> None:
        """Remember one delivered message (running or prefetched) as reserved by ``owner``."""
        self.record_receipts(
            [Receipt(work_key, task_name, task_id, args_digest, message_json)], owner,
            lease_seconds)

    @guarded
    def record_receipts(self, receipts: Sequence[Receipt], owner: Owner,
                        lease_seconds: float) -> None:
        """Record many deliveries in one statement (the worker batches them).

        A claim that is reserved or requeued becomes reserved by ``owner``; a running, done,
        failed or dead one keeps its state and owner. Either way the exact broker message is
        kept, so any claim can be re-published.
        """
        if not receipts:
            return
        unique = {r.work_key: r for r in receipts}  # one row per key per statement
        rows = [{"work_key": r.work_key, "task_name": r.task_name, "task_id": r.task_id,
                 "args_digest": r.args_digest, "message_json": r.message_json,
                 "node": owner.node, "inc": owner.incarnation, "lease": lease_seconds}
                for r in unique.values()]
        with self.begin() as conn:
            if not self.dialect.is_sqlite:
                # A receipt is a hint the broker can always give again: it need not wait
                # for the WAL flush. Claims, checkpoints and results always do.
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            conn.execute(self._hot.receipt, rows)  # executemany: batched VALUES

    @guarded
    def record_submission(
        self, work_key: str, task_name: str, task_id: str, args_digest: str | None,
        message_json: str, timeout: float,
    ) -> None:
        """Durable submit: the message is in the store before the broker sees it."""
        w = self.t.work
        now = self.dialect.now()
        stmt = self.dialect.insert(w).values(
            work_key=work_key, task_name=task_name, task_id=task_id, args_digest=args_digest,
            state=REQUEUED, epoch=self._first_epoch(work_key), lease_expires_at=now + timeout,
            attempts=0, deaths=0,
            republished=0, message_json=message_json, created_at=now, updated_at=now,
        ).on_conflict_do_nothing(index_elements=[w.c.work_key])
        with self.begin() as conn:
            conn.execute(stmt)

    @guarded
    def take(
        self, work_key: str, task_name: str, task_id: str, args_digest: str | None,
        owner: Owner, lease_seconds: float, max_attempts: int,
        is_live: Callable[[str | None, str | None, int | None], bool],
        supersedes: int | None = None,
        message_if_new: Callable[[], str | None] | None = None,
        retries: int = 0,
    ) -> TakeOutcome:
        """Claim ``work_key`` for one execution (epoch + 1), or say why it must not run.

        ``is_live(node, incarnation, pid)`` tells whether an execution recorded by this very
        worker incarnation is still alive; other owners are judged by their lease.
        ``supersedes`` is the epoch a re-sent message was sent to replace (store outage).
        ``message_if_new`` builds a re-publishable message when no receipt was recorded yet.
        ``retries`` is the delivery's Celery retry count: a copy of an earlier try than the
        one that holds or last held the claim is a stale duplicate and never runs.
        """
        w = self.t.work
        with self.single() as conn:
            fast = self._take_fast(conn, work_key, task_id, args_digest, owner, lease_seconds,
                                   max_attempts, retries, supersedes)
        if fast is not None:
            return fast
        proved = False
        for _ in range(3):
            try:
                with self.begin() as conn:
                    outcome = self._take(conn, work_key, task_name, task_id, args_digest,
                                         owner, lease_seconds, max_attempts, is_live,
                                         supersedes, message_if_new, retries)
            except IntegrityError:
                continue  # a concurrent first insert of the same key: read it again
            if outcome.held_by is None or proved or self.dialect.is_sqlite:
                return outcome
            # Held by another worker whose lease still runs: it may have just died (a
            # broker such as RabbitMQ redelivers its messages at once, before any sweep
            # has judged it). Its liveness session says so in milliseconds.
            proved = True
            if self.prove_dead(outcome.held_by) != PROVEN_DEAD:
                return outcome
            log.info("incarnation %s proven dead by its ended session: work %s taken over",
                     outcome.held_by, work_key,
                     extra={"action": "proven_dead", "work_key": work_key})
        raise StoreUnavailable(f"could not claim work {work_key!r} ({w.name} kept changing)")

    def _take(
        self, conn: Connection, work_key: str, task_name: str, task_id: str,
        args_digest: str | None, owner: Owner, lease_seconds: float, max_attempts: int,
        is_live: Callable[[str | None, str | None, int | None], bool],
        supersedes: int | None,
        message_if_new: Callable[[], str | None] | None,
        retries: int,
    ) -> TakeOutcome:
        w, rv = self.t.work, self.t.revocations
        now = self.dialect.now()
        fast = self._take_fast(conn, work_key, task_id, args_digest, owner, lease_seconds,
                               max_attempts, retries, supersedes)
        if fast is not None:  # it changed since the first attempt outside this transaction
            return fast
        revoked = conn.execute(select(rv.c.task_id).where(rv.c.task_id == task_id)).first()
        wk = self.t.workers
        owner_row = select(wk.c.incarnation).where(wk.c.incarnation == w.c.incarnation)
        old = self.t.old_checkpoints
        old_row = old.c.work_key == w.c.work_key
        row = conn.execute(
            select(w, self.dialect.now().label("db_now"),
                   select(old.c.state_json).where(old_row).scalar_subquery()
                   .label("old_state_json"),
                   select(old.c.seq).where(old_row).scalar_subquery().label("old_seq"),
                   exists(owner_row).label("owner_known"),
                   exists(owner_row.where(self._incarnation_live(lease_seconds)))
                   .label("owner_live"))
            .where(w.c.work_key == work_key)
            .with_for_update(of=w)
        ).first()
        if row is None:
            # Taken before the worker's receipt was flushed: keep a message that can be
            # re-published anyway (the receipt, when it lands, replaces it with the original).
            fg = self.t.forgotten
            base = int(conn.execute(select(fg.c.epoch).where(fg.c.work_key == work_key)
                                    ).scalar_one_or_none() or 0)
            epoch = base if revoked else base + 1
            conn.execute(w.insert().values(
                work_key=work_key, task_name=task_name, task_id=task_id,
                args_digest=args_digest, state=REVOKED if revoked else RUNNING,
                epoch=epoch, owner_node=owner.node,
                incarnation=owner.incarnation, owner_pid=owner.pid,
                lease_expires_at=now + lease_seconds, attempts=0 if revoked else 1, deaths=0,
                republished=0, retries=retries,
                message_json=message_if_new() if message_if_new else None,
                created_at=now, updated_at=now, finished_at=now if revoked else None,
            ))
            if revoked:
                return TakeOutcome("stopped", reason=REVOKED)
            return TakeOutcome("run", Claim(work_key, epoch, 1, 0))
        if args_digest and row.args_digest and args_digest != row.args_digest:
            raise WorkKeyConflict(
                f"work key {work_key!r} was already used by task {row.task_id} with different "
                "arguments; derive work keys from everything that makes the work distinct"
            )
        if row.state == DONE:
            return TakeOutcome("done", result_json=row.result_json)
        if row.state == DEAD:
            return TakeOutcome("dead", reason=row.error or "")
        if row.state in ENDED_BY_REQUEST and row.task_id == task_id:
            if row.state in STOPPED_STATES:
                return TakeOutcome("stopped", reason=row.state)
            if row.state == FAILED:
                return TakeOutcome("failed", result_json=row.result_json,
                                   reason=row.error or "failed")
            return TakeOutcome("duplicate", reason=f"this request already ended ({row.state})")
        if row.state in OPEN_STATES and retries < row.retries and row.task_id == task_id:
            return TakeOutcome("duplicate", reason=(
                f"a stale copy of try {retries}; try {row.retries} holds or held the claim"))
        if (row.state == REQUEUED and row.handed_to is not None and supersedes != row.handed_to
                and row.task_id == task_id):
            return TakeOutcome("duplicate", reason=(
                f"a copy of a request that was replaced at epoch {row.handed_to}; the "
                "replacement takes the work"))
        died = False
        if row.state == RUNNING:
            if row.epoch != supersedes and self._running_elsewhere(row, owner, is_live):
                other = row.incarnation if row.incarnation != owner.incarnation else None
                return TakeOutcome(
                    "held", reason=f"running on {row.owner_node} (epoch {row.epoch})",
                    held_by=other)
            # A copy re-sent by the execution itself (store outage, retry) replaces it. A
            # claim taken by a main process that died before its pool was seen to start it
            # (store/batched_takes.py) did not die running: no death.
            died = row.epoch != supersedes and row.owner_pid != UNSTARTED_PID
        # A new request for a key whose earlier request ended starts a fresh crash count.
        deaths = (0 if row.state in ENDED_BY_REQUEST else row.deaths) + (1 if died else 0)
        if revoked:
            # Revoked by id: a copy delivered after a restart, or one this worker never heard
            # the revoke for, runs nothing; the work ends only if it is this request's.
            if row.state in OPEN_STATES and row.task_id == task_id:
                self._end(conn, work_key, REVOKED, deaths=deaths, error="revoked by task id")
            return TakeOutcome("stopped", reason=REVOKED)
        if deaths >= max_attempts:
            reason = f"its execution died {deaths} times (resilient_max_attempts={max_attempts})"
            self._end(conn, work_key, DEAD, deaths=deaths, error=reason)
            return TakeOutcome("dead", reason=reason)
        epoch = row.epoch + 1
        conn.execute(update(w).where(w.c.work_key == work_key).values(
            state=RUNNING, epoch=epoch, owner_node=owner.node, incarnation=owner.incarnation,
            owner_pid=owner.pid, lease_expires_at=now + lease_seconds,
            attempts=row.attempts + 1, deaths=deaths, task_id=task_id, error=None,
            checkpoint_takes=w.c.checkpoint_takes + 1, handed_to=None,
            retries=retries, args_digest=func.coalesce(w.c.args_digest, args_digest),
            result_json=None, finished_at=None, updated_at=now,
        ))
        # The update adds one to the epoch and to checkpoint_takes: the same test on the row
        # as read.
        return TakeOutcome("run", Claim(work_key, epoch, row.attempts + 1, deaths,
                                        Resume(checkpoint_to_resume(row))))

    def take_batch(self, takes: Sequence[TakeRequest], started: Sequence[Started],
                   owner: Owner, lease_seconds: float, max_attempts: int,
                   finishes: Sequence[Finish] = ()) -> tuple[dict[str, Claim], set[str]]:
        """The worker's main process takes the claims of many deliveries at once (see
        :mod:`celery_resilient.store.batched_takes`) and marks ``started`` claims; returns
        the claims taken by work key, and the keys of ``finishes`` committed ``done`` (the
        group commit of results pool processes handed over; PostgreSQL). A key not returned
        is left to its pool process's careful :meth:`take`.

        Not ``guarded``: a failure is left to the caller, which then dispatches the batch
        without claims (each pool process takes its own, with its store-outage handling);
        a take that committed before its reply was lost is one those careful takes see as
        this worker's and leave alone until the worker lets it go (``reconcile``).
        """
        if not takes and not started and not finishes:
            return {}, set()
        if self.dialect.is_sqlite:
            with self.begin() as conn:
                rows, finished = self._batched.run(conn, takes, started, owner.node,
                                                   owner.incarnation, lease_seconds,
                                                   max_attempts, finishes)
        else:
            with self.single() as conn:
                rows, finished = self._batched.run(conn, takes, started, owner.node,
                                                   owner.incarnation, lease_seconds,
                                                   max_attempts, finishes)
        claims: dict[str, Claim] = {}
        for row in rows:
            view = RowView(row)
            claims[row["work_key"]] = Claim(row["work_key"], int(row["epoch"]),
                                            int(row["attempts"]), int(row["deaths"]),
                                            Resume(checkpoint_to_resume(view)))
        return claims, finished

    def _end(self, conn: Connection, work_key: str, state: str, error: str,
             deaths: Any = None) -> None:
        """Move ``work_key`` to a terminal ``state`` inside ``conn``'s transaction."""
        w = self.t.work
        conn.execute(update(w).where(w.c.work_key == work_key).values(
            **self.ended(state, error), deaths=w.c.deaths if deaths is None else deaths))

    def _take_fast(self, conn: Connection, work_key: str, task_id: str,
                   args_digest: str | None, owner: Owner, lease_seconds: float,
                   max_attempts: int, retries: int = 0,
                   supersedes: int | None = None) -> TakeOutcome | None:
        """The common take in one statement, or None when the careful path must decide."""
        row = self._hot.run(conn, "take_fast", {
            "k": work_key, "max_attempts": max_attempts, "digest": args_digest,
            "node": owner.node, "inc": owner.incarnation, "pid": owner.pid,
            "lease": lease_seconds, "task_id": task_id, "retries": retries,
            "supersedes": supersedes,
        }).row
        if row is None:
            return None
        return TakeOutcome("run", Claim(work_key, int(row.epoch), int(row.attempts),
                                        int(row.deaths), Resume(checkpoint_to_resume(row))))

    @staticmethod
    def _running_elsewhere(
        row: Row[Any], owner: Owner,
        is_live: Callable[[str | None, str | None, int | None], bool],
    ) -> bool:
        """Whether the execution recorded in ``row`` may still be running.

        Judged by liveness, never by name: this incarnation asks its own process table; a
        lapsed claim (no owner) runs nowhere; another incarnation is live while its lease
        row is (even under the same node name); an owner without a lease row (``apply()``
        outside a worker) is live while the claim's own lease lasts.
        """
        if row.incarnation is None:
            return False
        if row.incarnation == owner.incarnation:
            if row.owner_pid == UNSTARTED_PID:
                return True  # this worker's main process took it for a request it holds
            return is_live(row.owner_node, row.incarnation, row.owner_pid)
        if row.owner_known:
            return bool(row.owner_live)
        return bool(row.lease_expires_at is not None and row.lease_expires_at > row.db_now)

    def _incarnation_live(self, lease_seconds: float) -> ColumnElement[bool]:
        """A ``workers`` row that holds a lease now: not stopped, not expired."""
        wk = self.t.workers
        lease_end = func.coalesce(wk.c.lease_expires_at, wk.c.heartbeat_at + lease_seconds)
        return and_(wk.c.stopped_at.is_(None), lease_end > self.dialect.now())

    @guarded
    def finish(self, work_key: str, epoch: int, result_json: str | None,
               flushed: bool = True) -> None:
        """Result and ``done`` together, before the broker ack; a stale epoch changes nothing.

        ``flushed`` False (PostgreSQL): committed without waiting for the WAL flush, for a
        caller whose acknowledgement waits for :meth:`flush` (a worker's batched takes)."""
        self._close(work_key, epoch, DONE, result_json=result_json,
                    statement="close" if flushed or self.dialect.is_sqlite else "close_unflushed")

    @guarded
    def flush(self) -> None:
        """Return once every commit made before this call is durable: a commit that waits for
        the WAL flush (``txid_current()`` gives this one a commit record to wait for) covers
        every earlier commit, those made without waiting included. SQLite: nothing to do."""
        if self.dialect.is_sqlite:
            return
        with self.single() as conn:
            conn.exec_driver_sql("SELECT txid_current()")

    @guarded
    def fail(self, work_key: str, epoch: int, error: str, state: str = FAILED,
             failure_json: str | None = None) -> None:
        """The execution ended without a result: ``failed``, or ``ignored`` (Celery's Ignore).

        ``failure_json``: the exception in Celery's JSON form, kept in ``result_json`` so a
        redelivered copy can tell Celery the same failure without running the body."""
        self._close(work_key, epoch, state, result_json=failure_json, error=error[:4000])

    @guarded
    def release(self, work_key: str, epoch: int, hold_seconds: float,
                next_retries: int | None = None, clear_checkpoint: bool = False,
                replaced: bool = False) -> None:
        """Hand the work back (a retry, a requeueing Reject or a replacement was sent): the
        next message takes it without a death; the sweeper re-sends it if that vanishes.

        ``next_retries`` is the retry count of the message that should take it: copies of
        earlier tries are refused from now on. ``replaced``: only the replacement's message
        (marked as superseding ``epoch``) takes it; copies of the replaced request are
        refused, and the sweeper leaves it to the replacement (Celery sends it).
        """
        w = self.t.work
        now = self.dialect.now()
        values: dict[str, Any] = {
            "state": REQUEUED, "owner_node": None, "incarnation": None, "owner_pid": None,
            "lease_expires_at": now + hold_seconds, "updated_at": now,
            "args_digest": None,  # a retry may carry other arguments: the next take records them
        }
        if next_retries is not None:
            values["retries"] = next_retries
        if replaced:
            values["handed_to"] = epoch
        with self.begin() as conn:
            self.fence(conn, work_key, epoch)
            if clear_checkpoint:
                values.update(NO_CHECKPOINT)
                delete_old_checkpoints(self.t, conn, [work_key])
            conn.execute(update(w).where(w.c.work_key == work_key).values(**values))

    @guarded
    def end_request(self, task_id: str, state: str, error: str,
                    failure_json: str | None = None) -> int:
        """End the open work of one request, by task id, from the worker's main process.

        Used for outcomes the pool process cannot record: a hard time limit (``failed``), a
        delivery Celery discarded as revoked or expired, a running task terminated by
        ``revoke(terminate=True)``. Returns how many rows changed (0 when it already ended).
        """
        w = self.t.work
        ending: ColumnElement[bool] = w.c.state.in_(OPEN_STATES)
        if state == EXPIRED:
            # Celery puts an expired id on its revoke list before it announces the expiry:
            # the revoke-list copy may have ended the work first; the expiry is the truth.
            ending = or_(ending, and_(w.c.state == REVOKED, w.c.error == REVOKE_LIST_ERROR))
        with self.begin() as conn:
            return int(conn.execute(
                update(w).where(w.c.task_id == task_id, ending)
                .values(**self.ended(state, error), result_json=failure_json)).rowcount)

    @guarded
    def is_revoked(self, task_id: str) -> bool:
        rv = self.t.revocations
        with self.engine.connect() as conn:
            found = conn.execute(select(rv.c.task_id).where(rv.c.task_id == task_id)).first()
            conn.rollback()
        return found is not None

    @guarded
    def record_revocations(self, task_ids: Sequence[str]) -> int:
        """Remember task ids revoked through Celery, and end their work that has not started.

        Running work keeps running, as in Celery; if its owner dies, the copy that would take
        it over ends as ``revoked`` instead (the take and the sweep check these ids).
        """
        if not task_ids:
            return 0
        w, rv = self.t.work, self.t.revocations
        now = self.dialect.now()
        ids = sorted(set(task_ids))
        with self.begin() as conn:
            conn.execute(self.dialect.insert(rv).values(created_at=now).on_conflict_do_nothing(
                index_elements=[rv.c.task_id]), [{"task_id": i} for i in ids])
            return int(conn.execute(
                update(w).where(w.c.task_id.in_(ids), w.c.state.in_((RESERVED, REQUEUED)))
                .values(**self.ended(REVOKED, REVOKE_LIST_ERROR))).rowcount)

    def _close(self, work_key: str, epoch: int, state: str, result_json: str | None = None,
               error: str | None = None, statement: str = "close") -> None:
        with self.single() as conn:
            res = self._hot.run(conn, statement, {"k": work_key, "e": epoch, "state": state,
                                                  "result_json": result_json, "error": error})
        if res.rowcount != 1:
            if state == DONE and self._already_finished(work_key, epoch, result_json):
                return  # this very finish committed; its reply was lost and it was retried
            raise self._refused(work_key, epoch, f"its {state} result was not recorded")

    def _already_finished(self, work_key: str, epoch: int, result_json: str | None) -> bool:
        w = self.t.work
        with self.engine.connect() as conn:
            row = conn.execute(select(w.c.state, w.c.epoch, w.c.result_json)
                               .where(w.c.work_key == work_key)).first()
            conn.rollback()
        return row is not None and (row.state, int(row.epoch), row.result_json) == (
            DONE, epoch, result_json)

    # -- incarnations: one lease row per worker start ------------------------------------

    @guarded
    def register(self, owner: Owner, process: str, lease_seconds: float) -> None:
        """Record this worker incarnation with its first lease (worker start)."""
        wk = self.t.workers
        now = self.dialect.now()
        ins = self.dialect.insert(wk).values(
            incarnation=owner.incarnation, node=owner.node, pid=owner.pid, process=process,
            started_at=now, heartbeat_at=now, lease_expires_at=now + lease_seconds)
        with self.begin() as conn:
            conn.execute(ins.on_conflict_do_update(
                index_elements=[wk.c.incarnation],
                set_={"heartbeat_at": now, "lease_expires_at": now + lease_seconds,
                      "process": process}))

    @guarded
    def heartbeat(self, owner: Owner, lease_seconds: float) -> bool:
        """Renew this incarnation's lease: one row, whatever the number of claims.

        The row never waits on a claim row a user's transaction holds (``ledger.atomic``).
        Returns False when another incarnation declared this one dead (its claims are
        being taken over; the caller logs it loudly).
        """
        wk = self.t.workers
        now = self.dialect.now()
        with self.single() as conn:
            stopped = conn.execute(
                update(wk).where(wk.c.incarnation == owner.incarnation)
                .values(heartbeat_at=now, lease_expires_at=now + lease_seconds)
                .returning(wk.c.stopped_at)).first()
            if stopped is None:  # the row was pruned: record it again
                conn.execute(self.dialect.insert(wk).values(
                    incarnation=owner.incarnation, node=owner.node, pid=owner.pid,
                    started_at=now, heartbeat_at=now, lease_expires_at=now + lease_seconds,
                ).on_conflict_do_nothing(index_elements=[wk.c.incarnation]))
                return True
        return stopped.stopped_at is None

    @guarded
    def other_incarnations(self, owner: Owner) -> list[IncarnationRow]:
        """Incarnations of ``owner``'s node name that have not stopped (worker start)."""
        wk = self.t.workers
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(wk, self.dialect.now().label("db_now"))
                .where(wk.c.node == owner.node, wk.c.incarnation != owner.incarnation,
                       wk.c.stopped_at.is_(None))).all()
            conn.rollback()
        return [IncarnationRow(r.incarnation, r.node, int(r.pid), r.process,
                               float(r.heartbeat_at),
                               None if r.lease_expires_at is None else float(r.lease_expires_at),
                               float(r.db_now),
                               None if r.liveness_server is None else float(r.liveness_server))
                for r in rows]

    @guarded
    def gone_incarnations(self, incarnations: Sequence[str], owner: Owner,
                          lease_seconds: float, judge_leases: bool = True) -> GoneIncarnations:
        """Of ``incarnations``, who is gone and how surely (see :class:`GoneIncarnations`).

        ``owner``'s own incarnation is never gone."""
        wanted = [i for i in incarnations if i != owner.incarnation]
        if not wanted:
            return GoneIncarnations(set(), set(), set())
        wk = self.t.workers
        lease_end = func.coalesce(wk.c.lease_expires_at, wk.c.heartbeat_at + lease_seconds)
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(wk.c.incarnation, wk.c.stopped_at.is_not(None).label("stopped"),
                       (wk.c.ended_by == ENDED_SESSION).label("session_ended"),
                       (lease_end < self.dialect.now()).label("expired"))
                .where(wk.c.incarnation.in_(wanted))).all()
            conn.rollback()
        dead = {r.incarnation for r in rows if r.stopped}
        # A session found ended is proof even within a lease of an outage (the grace is for
        # owners that could not renew; this one's executions have fenced themselves).
        unproven = {r.incarnation for r in rows if not r.stopped and (
            r.session_ended or (judge_leases and r.expired))}
        return GoneIncarnations(dead, unproven, set(wanted) - {r.incarnation for r in rows})

    @guarded
    def record_liveness(self, owner: Owner, server: float | None) -> None:
        """The server start ``owner`` took its liveness lock on (None: it holds none)."""
        wk = self.t.workers
        with self.begin() as conn:
            conn.execute(update(wk).where(wk.c.incarnation == owner.incarnation)
                         .values(liveness_server=server))

    @guarded
    def sees_liveness_lock(self, owner: Owner) -> bool:
        """Whether the store's own database sees ``owner``'s liveness lock held: if not, the
        lock is on another database or server (``resilient_liveness_url`` misconfigured)
        and every probe from the store would prove ``owner`` dead while it lives."""
        if self.dialect.is_sqlite:
            return False
        with self.engine.connect() as conn:
            seen = liveness.held_in_this_database(
                conn, liveness.lock_key(self.prefix, owner.incarnation))
            conn.rollback()
        return seen

    @guarded
    def take_session_mark(self, owner: Owner) -> bool:
        """Clear the mark another worker left when it found ``owner``'s session ended; True
        if there was one (its resumable work was taken: its executions must stop). Called
        by ``owner`` holding its liveness lock again, so no new mark can come meanwhile."""
        wk = self.t.workers
        with self.begin() as conn:
            return bool(conn.execute(
                update(wk).where(wk.c.incarnation == owner.incarnation,
                                 wk.c.ended_by == ENDED_SESSION, wk.c.stopped_at.is_(None))
                .values(ended_by=None)).rowcount)

    @guarded
    def lock_suspects(self, owner: Owner, stale_seconds: float) -> list[str]:
        """Other incarnations whose liveness lock a probe may take: not stopped, their lease
        not yet over (a probe is to beat it), holding a lock taken on this server start
        (PostgreSQL), quiet for ``stale_seconds``."""
        if self.dialect.is_sqlite:
            return []
        wk = self.t.workers
        with self.engine.connect() as conn:
            here = liveness.server_start(conn)
            rows = conn.execute(
                select(wk.c.incarnation, wk.c.liveness_server)
                .where(wk.c.incarnation != owner.incarnation, wk.c.stopped_at.is_(None),
                       wk.c.liveness_server.is_not(None), wk.c.ended_by.is_(None),
                       wk.c.lease_expires_at > self.dialect.now(),
                       wk.c.heartbeat_at < self.dialect.now() - stale_seconds)).all()
            conn.rollback()
        return [r.incarnation for r in rows if abs(float(r.liveness_server) - here) < 1e-3]

    @guarded
    def prove_dead(self, incarnation: str, by: Owner | None = None) -> str:
        """Take ``incarnation``'s liveness lock and, holding it, record what its ended
        session proves, in the same transaction.

        ``PROVEN_DEAD`` only with proof: its lock was taken on the server running now and no
        other session holds it, so its session has ended. For a later start of the same node
        name (``by``) that ends the incarnation (stopped, ``successor``): its process is gone,
        everything it held goes back. For any other worker it may still run behind a
        partition, so its lease is ended instead: its resumable work is taken back now (its
        executions are fenced), and it renews its lease again if it comes back.
        ``SESSION_ALIVE``: another session holds the lock. ``UNJUDGED``: no proof either way
        (no lock recorded, a server restarted since, SQLite, already stopped, or this very
        backend holds the lock: a pooler in transaction mode)."""
        if self.dialect.is_sqlite:
            return UNJUDGED
        wk = self.t.workers
        key = liveness.lock_key(self.prefix, incarnation)
        with self.begin() as conn:
            row = conn.execute(select(wk.c.liveness_server, wk.c.stopped_at, wk.c.node)
                               .where(wk.c.incarnation == incarnation)
                               .with_for_update()).first()
            if row is None or row.stopped_at is not None or row.liveness_server is None:
                return UNJUDGED
            if abs(float(row.liveness_server) - liveness.server_start(conn)) >= 1e-3:
                return UNJUDGED  # taken on a server that has restarted since: no proof
            if liveness.held_by_this_backend(conn, key):
                log.warning("the liveness lock of incarnation %s is held by this very "
                            "database session: a pooler in transaction mode? Set "
                            "resilient_liveness_url to a direct PostgreSQL URL", incarnation,
                            extra={"action": "liveness_pooler"})
                return UNJUDGED
            if not liveness.try_lock_for_transaction(conn, key):
                return SESSION_ALIVE
            now = self.dialect.now()
            if by is not None and by.node == row.node:
                values: dict[str, Any] = {"stopped_at": now, "lease_expires_at": now,
                                          "ended_by": ENDED_SUCCESSOR}
            else:  # liveness_server kept: a later start of its node name can still prove it
                values = {"lease_expires_at": now, "ended_by": ENDED_SESSION}
            conn.execute(update(wk).where(wk.c.incarnation == incarnation).values(**values))
        return PROVEN_DEAD

    @guarded
    def declare_dead(self, incarnation: str) -> bool:
        """Mark an incarnation proven dead: sweepers take its claims back at once."""
        wk = self.t.workers
        now = self.dialect.now()
        with self.begin() as conn:
            return bool(conn.execute(
                update(wk).where(wk.c.incarnation == incarnation, wk.c.stopped_at.is_(None))
                .values(stopped_at=now, lease_expires_at=now,
                        ended_by=ENDED_PROCESS)).rowcount)

    @guarded
    def mark_draining(self, owner: Owner) -> None:
        """A warm shutdown began: shown by ``status``; the lease is still renewed."""
        wk = self.t.workers
        with self.begin() as conn:
            conn.execute(update(wk).where(wk.c.incarnation == owner.incarnation,
                                          wk.c.draining_at.is_(None))
                         .values(draining_at=self.dialect.now()))

    @guarded
    def up_for(self) -> float | None:
        """Seconds since the database server started (PostgreSQL), else None.

        A server restarted less than a lease ago was down: nobody could renew a lease then.
        """
        if self.dialect.is_sqlite:
            return None
        with self.engine.connect() as conn:
            value = conn.exec_driver_sql(
                "SELECT EXTRACT(EPOCH FROM now() - pg_postmaster_start_time())").scalar_one()
            conn.rollback()
        return float(value)

    @guarded
    def reconcile(self, owner: Owner, pid_alive: Callable[[int | None], bool] | None = None,
                  held: frozenset[str] | None = None, executing: frozenset[str] | None = None,
                  grace_seconds: float = 5.0, resent: frozenset[str] = frozenset(),
                  resend_hold: float = 60.0, lease_seconds: float = 30.0,
                  finishing: frozenset[str] = frozenset()) -> int:
        """Release this incarnation's claims that run nowhere; return how many.

        The incarnation's lease keeps every claim it names alive, so a claim whose execution
        is gone must be let go explicitly, or it would stay open as long as the worker lives:

        - a running claim whose pool process died (``pid_alive``), e.g. a SIGKILLed child,
          loses its owner: the next sweep re-publishes it and counts a death;
        - a running claim whose task id is not ``executing`` in this worker's pool,
          untouched for ``grace_seconds`` (a take lands a moment before the main process
          hears its pool process accepted the task), ended without recording an outcome: a
          lost take reply, a failed hand-back, or a store-outage re-send (its task id in
          ``resent``). It goes back to ``requeued`` without a death: a copy in flight takes
          it; the sweep re-publishes it at once, or after ``resend_hold`` for a re-send;
        - a reserved claim whose message the worker no longer ``held`` (acked or rejected
          without the work ending), and not re-sent, loses its owner: the next sweep
          re-publishes it.

        Claims whose bodies ended here and whose results the worker's main process has not
        committed yet (``finishing``, by work key: the group commit) are left alone.

        The claims of eager executions (``task.apply()`` inside a task) of this worker's
        live processes get their own lease renewed (``lease_seconds``).
        """
        w = self.t.work
        now = self.dialect.now()
        with self.begin() as conn:
            rows = conn.execute(
                select(w.c.work_key, w.c.task_id, w.c.state, w.c.epoch, w.c.owner_pid,
                       (w.c.updated_at < now - grace_seconds).label("quiet"))
                .where(w.c.incarnation == owner.incarnation,
                       w.c.state.in_((RUNNING, RESERVED)))).all()
            dead_pids: dict[int, bool] = {}
            lapse: list[tuple[str, int, str]] = []
            let_go: list[tuple[str, int, float]] = []
            for r in rows:
                if r.work_key in finishing:
                    continue  # ended here: its result is on its way to the store
                if r.state == RESERVED:
                    if held is not None and r.task_id not in held and r.task_id not in resent:
                        lapse.append((r.work_key, int(r.epoch), "its message is no longer held"))
                    continue
                pid = r.owner_pid
                if pid == UNSTARTED_PID and (held is None or r.task_id in held):
                    continue  # taken for a request it (may) still hold: on its way to the pool
                if pid_alive is not None and pid and pid != owner.pid:
                    if pid not in dead_pids:
                        dead_pids[pid] = not pid_alive(pid)
                    if dead_pids[pid]:
                        lapse.append((r.work_key, int(r.epoch), f"pool process {pid} is gone"))
                        continue
                if executing is not None and r.task_id not in executing and r.quiet:
                    let_go.append((r.work_key, int(r.epoch),
                                   resend_hold if r.task_id in resent else 0.0))
            mine = w.c.incarnation == owner.incarnation
            # Eager executions in this worker's processes (task.apply() inside a task) are
            # not Celery requests: they keep their claim by its own lease, renewed here
            # while their process lives.
            eager = select(w.c.owner_pid).distinct().where(
                w.c.incarnation == owner.incarnation + EAGER_SUFFIX, w.c.state == RUNNING)
            eager_pids = [p for p in conn.execute(eager).scalars() if p is not None]
            gone = [p for p in eager_pids if pid_alive is not None and not pid_alive(p)]
            if eager_pids:
                conn.execute(update(w).where(
                    w.c.incarnation == owner.incarnation + EAGER_SUFFIX, w.c.state == RUNNING,
                    w.c.owner_pid.not_in(gone)).values(lease_expires_at=now + lease_seconds))
            for key, epoch, why in lapse:
                conn.execute(update(w).where(mine, w.c.work_key == key, w.c.epoch == epoch,
                                             w.c.state.in_((RUNNING, RESERVED)))
                             .values(incarnation=None, owner_pid=None, lease_expires_at=now))
                log.warning("claim on %s released: %s", key, why,
                            extra={"action": "lease_lapsed", "work_key": key, "reason": why})
            for key, epoch, hold in let_go:
                conn.execute(update(w).where(mine, w.c.work_key == key, w.c.epoch == epoch,
                                             w.c.state == RUNNING)
                             .values(state=REQUEUED, owner_node=None, incarnation=None,
                                     owner_pid=None, lease_expires_at=now + hold,
                                     updated_at=now))
                log.warning("work %s requeued: its execution ended without an outcome%s", key,
                            f"; its re-sent copy has {hold:.0f}s to take it" if hold else "",
                            extra={"action": "let_go", "work_key": key})
        return len(lapse) + len(let_go)

    @guarded
    def release_reserved(self, owner: Owner) -> int:
        """Let go of ``owner``'s reserved claims and the claims it took but never saw start
        (work received, not started): other workers' sweeps re-publish them. For a worker
        cut off from its broker (which first voids the claims it handed to its pool:
        ``tasks.handed.void_all``)."""
        w = self.t.work
        now = self.dialect.now()
        mine = w.c.incarnation == owner.incarnation
        with self.begin() as conn:
            reserved = conn.execute(
                update(w).where(mine, w.c.state == RESERVED)
                .values(incarnation=None, owner_pid=None, lease_expires_at=now)).rowcount
            unstarted = conn.execute(
                update(w).where(mine, w.c.state == RUNNING, w.c.owner_pid == UNSTARTED_PID)
                .values(state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
                        lease_expires_at=now, updated_at=now)).rowcount
            return int(reserved) + int(unstarted)

    @guarded
    def release_unstarted(self, owner: Owner, claims: Sequence[tuple[str, int]],
                          hold_seconds: float) -> int:
        """Hand back claims ``owner``'s main process took (``(work key, epoch)``) for
        requests it dropped before its pool saw them start (a lost broker connection, a
        shutdown): ``requeued``, no death, for the copy the broker delivers again; the sweep
        re-publishes one only if none took it within ``hold_seconds``."""
        w = self.t.work
        now = self.dialect.now()
        released = 0
        with self.begin() as conn:
            for key, epoch in claims:
                released += int(conn.execute(
                    update(w).where(w.c.work_key == key, w.c.epoch == epoch,
                                    w.c.state == RUNNING, w.c.owner_pid == UNSTARTED_PID,
                                    w.c.incarnation == owner.incarnation)
                    .values(state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
                            lease_expires_at=now + hold_seconds, updated_at=now)).rowcount)
        return released

    @guarded
    def mark_stopped(self, owner: Owner, hold_seconds: float) -> None:
        """A clean stop: prefetched claims go back to ``requeued``; the incarnation is over.

        The broker redelivers prefetched messages itself on a clean stop; if it does not
        within ``hold_seconds``, the sweeper re-publishes them. Claims still running (a cold
        shutdown) are orphans at once: their owner is stopped.
        """
        w, wk = self.t.work, self.t.workers
        now = self.dialect.now()
        with self.begin() as conn:
            conn.execute(update(w).where(w.c.incarnation == owner.incarnation,
                                         or_(w.c.state == RESERVED,
                                             and_(w.c.state == RUNNING,
                                                  w.c.owner_pid == UNSTARTED_PID)))
                         .values(state=REQUEUED, owner_node=None, incarnation=None,
                                 owner_pid=None, lease_expires_at=now + hold_seconds,
                                 updated_at=now))
            conn.execute(update(wk).where(wk.c.incarnation == owner.incarnation)
                         .values(stopped_at=now, lease_expires_at=now, ended_by=ENDED_STOP))

    @guarded
    def claim_orphans(self, owner: Owner, limit: int, hold_seconds: float,
                      max_republish: int | None = None,
                      max_hold_seconds: float | None = None,
                      ended: list[Ended] | None = None,
                      lease_seconds: float = 30.0, judge_leases: bool = True) -> list[Orphan]:
        """Take back work whose owner is gone, and mark it re-published.

        An orphan is an open claim whose owner is known to be gone: its incarnation stopped
        or was proven dead (taken at once), its incarnation's lease expired, or it has no
        owner (handed back, released, re-published) and its hold expired. An owner without
        a lease row (``apply()`` outside a worker) is judged by the claim's own lease.
        With ``judge_leases`` False (the store was just unreachable, so nobody could renew
        a lease) only stopped owners and ownerless claims are taken. Rows locked by another
        sweeper are skipped (PostgreSQL), so two sweepers never re-publish the same orphan in
        one round. The caller publishes after this commits; if it crashes first, the new
        hold expires and a later sweep sends it again.

        Re-publishing is bounded: the n-th re-publish since the work last started waits
        ``hold_seconds * 2**n`` (at most ``max_hold_seconds``) for a worker to take it, and
        after ``max_republish`` of them the work is parked ``dead``. An orphan whose task id
        was revoked ends ``revoked`` instead of being sent. Work ended here is appended to
        ``ended`` (its caller still waits on a result the dead owner never wrote).
        """
        w, rv, wk = self.t.work, self.t.revocations, self.t.workers
        now = self.dialect.now()
        owner_row = select(wk.c.incarnation).where(wk.c.incarnation == w.c.incarnation)
        # stopped, or found without its session by another worker (see prove_dead)
        stopped = exists(owner_row.where(or_(wk.c.stopped_at.is_not(None),
                                             wk.c.ended_by == ENDED_SESSION)))
        own_deadline = and_(~exists(owner_row), w.c.lease_expires_at < now)
        if judge_leases:
            # Never the sweeper's own incarnation: it is alive (it is sweeping), and it lets
            # go of its own claims that run nowhere itself (``reconcile``).
            expired = exists(owner_row.where(
                wk.c.incarnation != owner.incarnation, wk.c.stopped_at.is_(None),
                func.coalesce(wk.c.lease_expires_at, wk.c.heartbeat_at + lease_seconds) < now))
            gone: ColumnElement[bool] = or_(stopped, expired, own_deadline)
        else:
            gone = or_(stopped, and_(own_deadline, w.c.incarnation.is_(None)))
        revoked = exists().where(rv.c.task_id == w.c.task_id).label("revoked")
        with self.begin() as conn:
            rows = conn.execute(
                select(w.c.work_key, w.c.task_id, w.c.task_name, w.c.message_json, w.c.state,
                       w.c.owner_node, w.c.owner_pid, w.c.deaths, w.c.republished, w.c.retries,
                       revoked)
                # a claim handed to a replacement waits for it (Celery sends it)
                .where(w.c.state.in_(OPEN_STATES), gone, w.c.handed_to.is_(None))
                .order_by(w.c.created_at)
                .limit(limit)
                .with_for_update(of=w, **self.dialect.lock_kwargs())
            ).all()
            orphans: list[Orphan] = []
            for r in rows:
                # a claim its worker took but never saw start (batched takes) did not die
                death = 1 if r.state == RUNNING and r.owner_pid != UNSTARTED_PID else 0
                if r.revoked:
                    why = "revoked by task id; its owner died"
                    self._end(conn, r.work_key, REVOKED, deaths=r.deaths + death, error=why)
                    if ended is not None:
                        ended.append(Ended(r.work_key, r.task_id, r.task_name, REVOKED, why))
                    continue
                if max_republish is not None and r.republished >= max_republish:
                    why = (f"re-published {r.republished} times without progress "
                           f"(resilient_max_republish={max_republish})")
                    self._end(conn, r.work_key, DEAD, deaths=r.deaths + death, error=why)
                    if ended is not None:
                        ended.append(Ended(r.work_key, r.task_id, r.task_name, DEAD, why))
                    log.error("work %s parked dead: re-published %d times without starting",
                              r.work_key, r.republished,
                              extra={"action": "dead", "work_key": r.work_key})
                    continue
                hold = hold_seconds * 2 ** min(r.republished, 30)
                if max_hold_seconds is not None:
                    hold = min(hold, max_hold_seconds)
                conn.execute(update(w).where(w.c.work_key == r.work_key).values(
                    state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
                    lease_expires_at=now + hold, republished=w.c.republished + 1,
                    deaths=w.c.deaths + death, updated_at=now,
                ))
                orphans.append(Orphan(r.work_key, r.task_id, r.task_name, r.message_json,
                                      r.state, r.owner_node, int(r.retries)))
        return orphans

    @guarded
    def park_unsendable(self, work_key: str, reason: str) -> bool:
        """End requeued work whose stored message cannot be sent (``dead``, with the reason).

        Only while it is still ``requeued``: a delivery of its own that took it meanwhile
        (the broker's copy) keeps running. Returns whether it was parked.
        """
        w = self.t.work
        with self.begin() as conn:
            return bool(conn.execute(
                update(w).where(w.c.work_key == work_key, w.c.state == REQUEUED)
                .values(**self.ended(DEAD, reason))).rowcount)

    @guarded
    def unsend(self, work_keys: Sequence[str], hold_seconds: float) -> None:
        """Orphans claimed for re-publishing that could not be sent (broker down): they do
        not count as re-published, and wait ``hold_seconds`` for the next sweep."""
        if not work_keys:
            return
        w = self.t.work
        now = self.dialect.now()
        with self.begin() as conn:
            conn.execute(update(w).where(w.c.work_key.in_(list(work_keys)),
                                         w.c.state == REQUEUED, w.c.republished > 0)
                         .values(republished=w.c.republished - 1,
                                 lease_expires_at=now + hold_seconds))

    @guarded
    def broker_lost(self, hold_seconds: float) -> int:
        """The broker lost what it had queued: work waiting ``requeued`` for its broker copy
        (a durable submit, a hand-back, a re-publish) is due now, for the next sweep to
        send, instead of when its hold expires. A submission or hand-back due later (an ETA,
        a retry's countdown) keeps that part of its hold: the hold beyond ``hold_seconds``.
        Returns how many were made due."""
        w = self.t.work
        now = self.dialect.now()
        later = w.c.lease_expires_at - hold_seconds
        due = case((w.c.republished > 0, now), (later > now, later), else_=now)
        with self.begin() as conn:
            return int(conn.execute(
                update(w).where(w.c.state == REQUEUED, w.c.incarnation.is_(None),
                                w.c.handed_to.is_(None), w.c.message_json.is_not(None),
                                w.c.lease_expires_at > now)
                .values(lease_expires_at=due)).rowcount)

    @guarded
    def withdraw_submission(self, work_key: str, task_id: str) -> bool:
        """A durable submit whose publish failed: its record goes, as the caller's
        ``apply_async`` raised and plain Celery sends nothing then. Only while nothing took
        it (a copy that reached the broker after all records it again when taken)."""
        w = self.t.work
        with self.begin() as conn:
            return bool(conn.execute(
                delete(w).where(w.c.work_key == work_key, w.c.task_id == task_id,
                                w.c.state == REQUEUED, w.c.attempts == 0,
                                w.c.republished == 0, w.c.incarnation.is_(None))).rowcount)

    # -- reads for operators and tests ----------------------------------------------------

    @guarded
    def get_work(self, work_key: str) -> WorkInfo | None:
        w = self.t.work
        with self.engine.connect() as conn:
            row = conn.execute(select(w).where(w.c.work_key == work_key)).first()
            conn.rollback()
        return None if row is None else work_info(row)

    @guarded
    def get_message(self, work_key: str) -> str | None:
        """The stored broker message of ``work_key`` (what a re-publish would send)."""
        w = self.t.work
        with self.engine.connect() as conn:
            value = conn.execute(select(w.c.message_json).where(w.c.work_key == work_key)
                                 ).scalar_one_or_none()
            conn.rollback()
        return value

    @guarded
    def list_work(self, state: str | None = None, limit: int = 1000) -> list[WorkInfo]:
        w = self.t.work
        q = select(w).order_by(w.c.created_at).limit(limit)
        if state:
            q = q.where(w.c.state == state)
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
            conn.rollback()
        return [work_info(r) for r in rows]

    @guarded
    def count_by_state(self) -> dict[str, int]:
        w = self.t.work
        with self.engine.connect() as conn:
            rows = conn.execute(select(w.c.state, func.count()).group_by(w.c.state)).all()
            conn.rollback()
        return {str(s): int(n) for s, n in rows}

    # -- checkpoints ------------------------------------------------------------------------

    @guarded
    def load_checkpoint(self, work_key: str) -> tuple[str, int] | None:
        """The checkpoint to resume from (see :func:`.checkpoint_compat.checkpoint_to_resume`); one
        autocommitted read on PostgreSQL."""
        w, old = self.t.work, self.t.old_checkpoints
        query = (select(w.c.checkpoint_json, w.c.checkpoint_seq, w.c.epoch, w.c.checkpoint_epoch,
                        w.c.checkpoint_takes, old.c.state_json.label("old_state_json"),
                        old.c.seq.label("old_seq"))
                 .outerjoin(old, old.c.work_key == w.c.work_key)
                 .where(w.c.work_key == work_key))
        with self.reading() as conn:
            row = conn.execute(query).first()
        return None if row is None else checkpoint_to_resume(row)

    @guarded
    def save_checkpoint(self, work_key: str, epoch: int, state_json: str) -> int:
        with self.single() as conn:
            row = self._hot.run(conn, "fenced_checkpoint",
                                {"k": work_key, "e": epoch, "state_json": state_json}).row
        if row is None:
            raise self._refused(work_key, epoch, "checkpoint refused")
        return int(row.checkpoint_seq)

    @guarded
    def clear_checkpoint(self, work_key: str, epoch: int) -> None:
        w = self.t.work
        with self.begin() as conn:
            self.fence(conn, work_key, epoch)
            conn.execute(update(w).where(w.c.work_key == work_key).values(**NO_CHECKPOINT))
            delete_old_checkpoints(self.t, conn, [work_key])

    # -- steps ------------------------------------------------------------------------------

    @guarded
    def get_step(self, work_key: str, name: str) -> str | None:
        s = self.t.steps
        with self.engine.connect() as conn:
            value = conn.execute(
                select(s.c.result_json).where(s.c.work_key == work_key, s.c.name == name)
            ).scalar_one_or_none()
            conn.rollback()
        return value

    @guarded
    def put_step(self, work_key: str, epoch: int, name: str, result_json: str) -> None:
        s = self.t.steps
        with self.begin() as conn:
            self.fence(conn, work_key, epoch)
            conn.execute(s.insert().values(work_key=work_key, name=name, epoch=epoch,
                                           result_json=result_json,
                                           created_at=self.dialect.now()))

    # -- ledger -----------------------------------------------------------------------------

    @guarded
    def ledger_get(self, key: str, conn: Connection | None = None) -> str | None:
        lg = self.t.ledger
        q = select(lg.c.result_json).where(lg.c.key == key)
        if conn is not None:
            return conn.execute(q).scalar_one_or_none()
        with self.engine.connect() as c:
            value = c.execute(q).scalar_one_or_none()
            c.rollback()
        return value

    def ledger_mark(self, conn: Connection, key: str, work_key: str | None, epoch: int | None,
                    result_json: str, fence: bool = True) -> bool:
        """Record ``key`` as applied inside ``conn``'s transaction; False if it already was."""
        lg = self.t.ledger
        if fence and work_key is not None and epoch is not None:
            self.fence(conn, work_key, epoch)
        stmt = self.dialect.insert(lg).values(
            key=key, work_key=work_key, epoch=epoch, result_json=result_json,
            applied_at=self.dialect.now(),
        ).on_conflict_do_nothing(index_elements=[lg.c.key]).returning(lg.c.key)
        # RETURNING, not rowcount: SQLAlchemy 2.1 reports rowcount -1 for INSERTs on psycopg.
        return conn.execute(stmt).first() is not None

    def ledger_set_result(self, conn: Connection, key: str, result_json: str) -> None:
        """Set the result of a marker inserted earlier in ``conn``'s transaction."""
        lg = self.t.ledger
        conn.execute(update(lg).where(lg.c.key == key).values(result_json=result_json))

    @guarded
    def ledger_put(self, key: str, work_key: str | None, epoch: int | None,
                   result_json: str) -> bool:
        with self.begin() as conn:
            return self.ledger_mark(conn, key, work_key, epoch, result_json)
