"""Claims: receipts, takes (one or a batch), and every way an execution ends its claim:
finish, fail, release, a request ended by Celery, revocations."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from celery_resilient.core.identity import Owner
from celery_resilient.core.states import (
    DONE,
    EXPIRED,
    FAILED,
    OPEN_STATES,
    REQUEUED,
    RESERVED,
    REVOKED,
    RUNNING,
)
from celery_resilient.core.take import Delivery, IsLive, TakeDecision, TakeRow, decide_take
from celery_resilient.errors import StoreUnavailable
from celery_resilient.store.batched_takes import BatchedTakes, Finish, Started, TakeRequest
from celery_resilient.store.batched_takes_mysql import MySQLBatchedTakes
from celery_resilient.store.checkpoint_compat import (
    RowView,
    checkpoint_to_resume,
    delete_old_checkpoints,
)
from celery_resilient.store.guard import guarded
from celery_resilient.store.incarnations import Incarnations
from celery_resilient.store.records import (
    NO_CHECKPOINT,
    PROVEN_DEAD,
    REVOKE_LIST_ERROR,
    Claim,
    Receipt,
    Resume,
    TakeAction,
    TakeOutcome,
)

log = logging.getLogger(__name__)


class Claims(Incarnations):
    """Receipts, takes, and every way an execution ends its claim."""

    def __init__(self, url: str, table_prefix: str = "resilient_") -> None:
        super().__init__(url, table_prefix)
        self._batched: BatchedTakes | MySQLBatchedTakes = (
            MySQLBatchedTakes if self.dialect.is_mysql else BatchedTakes)(self.t, self.dialect)

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
            if self.dialect.name == "postgresql":
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
        owner: Owner, lease_seconds: float, max_attempts: int, is_live: IsLive,
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
        is_live: IsLive, supersedes: int | None,
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
            .with_for_update(**self.dialect.lock_of(w))
        ).first()
        facts = None if row is None else TakeRow.of(row)
        decision = decide_take(
            facts, Delivery(work_key, task_id, args_digest, retries, supersedes,
                            owner.incarnation, revoked is not None),
            max_attempts, is_live)
        if row is None:
            # Taken before the worker's receipt was flushed: keep a message that can be
            # re-published anyway (the receipt, when it lands, replaces it with the original).
            fg = self.t.forgotten
            base = int(conn.execute(select(fg.c.epoch).where(fg.c.work_key == work_key)
                                    ).scalar_one_or_none() or 0)
            ended = decision.end_state is not None
            epoch = base if ended else base + 1
            conn.execute(w.insert().values(
                work_key=work_key, task_name=task_name, task_id=task_id,
                args_digest=args_digest, state=decision.end_state or RUNNING,
                epoch=epoch, owner_node=owner.node,
                incarnation=owner.incarnation, owner_pid=owner.pid,
                lease_expires_at=now + lease_seconds, attempts=0 if ended else 1, deaths=0,
                republished=0, retries=retries,
                message_json=message_if_new() if message_if_new else None,
                created_at=now, updated_at=now, finished_at=now if ended else None,
            ))
            return _outcome(decision, None if ended else Claim(work_key, epoch, 1, 0))
        if decision.end_state is not None:
            self._end(conn, work_key, decision.end_state, deaths=decision.deaths,
                      error=decision.end_error)
        if decision.action is not TakeAction.RUN:
            return _outcome(decision)
        epoch = row.epoch + 1
        conn.execute(update(w).where(w.c.work_key == work_key).values(
            state=RUNNING, epoch=epoch, owner_node=owner.node, incarnation=owner.incarnation,
            owner_pid=owner.pid, lease_expires_at=now + lease_seconds,
            attempts=row.attempts + 1, deaths=decision.deaths, task_id=task_id, error=None,
            checkpoint_takes=w.c.checkpoint_takes + 1, handed_to=None,
            retries=retries, args_digest=func.coalesce(w.c.args_digest, args_digest),
            result_json=None, finished_at=None, updated_at=now,
        ))
        # The update adds one to the epoch and to checkpoint_takes: the same test on the row
        # as read.
        return _outcome(decision, Claim(work_key, epoch, row.attempts + 1, decision.deaths,
                                        Resume(checkpoint_to_resume(row))))

    def take_batch(self, takes: Sequence[TakeRequest], started: Sequence[Started],
                   owner: Owner, lease_seconds: float, max_attempts: int,
                   finishes: Sequence[Finish] = (), deferred: list[Started] | None = None,
                   ) -> tuple[dict[str, Claim], set[str]]:
        """The worker's main process takes the claims of many deliveries at once (see
        :mod:`celery_resilient.store.batched_takes`) and marks ``started`` claims; returns
        the claims taken by work key, and the keys of ``finishes`` committed ``done`` (the
        group commit of results pool processes handed over; PostgreSQL). A key not returned
        is left to its pool process's careful :meth:`take`. A mark whose row another
        transaction holds (a running body's ``ledger.atomic()``) is not waited for: it is
        appended to ``deferred``, for a later batch (SQLite has one writer).

        Not ``guarded``: a failure is left to the caller, which then dispatches the batch
        without claims (each pool process takes its own, with its store-outage handling);
        a take that committed before its reply was lost is one those careful takes see as
        this worker's and leave alone until the worker lets it go (``reconcile``).
        """
        if not takes and not started and not finishes:
            return {}, set()
        # PostgreSQL: one statement; MySQL: one packet of statements on an autocommitted
        # session, its transaction's begin and commit included; SQLite: a transaction.
        with self.begin() if self.dialect.is_sqlite else self.single() as conn:
            rows, finished = self._batched.run(conn, takes, started, owner.node,
                                               owner.incarnation, lease_seconds, max_attempts,
                                               finishes, deferred)
        claims: dict[str, Claim] = {}
        for row in rows:
            view = RowView(row)
            claims[row["work_key"]] = Claim(row["work_key"], int(row["epoch"]),
                                            int(row["attempts"]), int(row["deaths"]),
                                            Resume(checkpoint_to_resume(view)))
        return claims, finished

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
        return TakeOutcome(TakeAction.RUN, Claim(work_key, int(row.epoch), int(row.attempts),
                                        int(row.deaths), Resume(checkpoint_to_resume(row))))

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
                    statement="close" if flushed or self.dialect.name != "postgresql"
                    else "close_unflushed")

    @guarded
    def flush(self) -> None:
        """Return once every commit made before this call is durable: a commit that waits for
        the WAL flush (``txid_current()`` gives this one a commit record to wait for) covers
        every earlier commit, those made without waiting included. SQLite, and MySQL (whose
        commits all wait for the redo log flush at ``innodb_flush_log_at_trx_commit = 1``,
        the default): nothing to do."""
        if self.dialect.name != "postgresql":
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
        with self.reading() as conn:
            found = conn.execute(select(rv.c.task_id).where(rv.c.task_id == task_id)).first()
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
        with self.reading() as conn:
            row = conn.execute(select(w.c.state, w.c.epoch, w.c.result_json)
                               .where(w.c.work_key == work_key)).first()
        return row is not None and (row.state, int(row.epoch), row.result_json) == (
            DONE, epoch, result_json)


def _outcome(decision: TakeDecision, claim: Claim | None = None) -> TakeOutcome:
    """What the pool process is told (``claim``: the one taken, when it is to run)."""
    return TakeOutcome(decision.action, claim, decision.result_json, decision.reason,
                       decision.held_by)
