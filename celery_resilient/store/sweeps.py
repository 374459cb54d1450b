"""Sweeps: what a worker takes back from gone owners and from its own claims that run
nowhere, and what it re-sends for a broker that lost its data."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sqlalchemy import (
    and_,
    case,
    delete,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement

from celery_resilient.core.identity import EAGER_SUFFIX, Owner
from celery_resilient.core.states import (
    DEAD,
    OPEN_STATES,
    REQUEUED,
    RESERVED,
    RUNNING,
    UNSTARTED_PID,
)
from celery_resilient.core.sweep import OwnClaim, judge_orphan, reconcile_claims
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.records import (
    ENDED_SESSION,
    ENDED_STOP,
    Ended,
    Orphan,
)

log = logging.getLogger(__name__)


class Sweeps(Database):
    """What the sweeps take back, release and re-send."""

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
            out = reconcile_claims(
                (OwnClaim(r.work_key, r.task_id, r.state, int(r.epoch), r.owner_pid,
                          bool(r.quiet)) for r in rows),
                owner.pid, pid_alive, held, executing, resent, finishing, resend_hold)
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
            for key, epoch, why in out.lapse:
                conn.execute(update(w).where(mine, w.c.work_key == key, w.c.epoch == epoch,
                                             w.c.state.in_((RUNNING, RESERVED)))
                             .values(incarnation=None, owner_pid=None, lease_expires_at=now))
                log.warning("claim on %s released: %s", key, why,
                            extra={"action": "lease_lapsed", "work_key": key, "reason": why})
            for key, epoch, hold in out.let_go:
                conn.execute(update(w).where(mine, w.c.work_key == key, w.c.epoch == epoch,
                                             w.c.state == RUNNING)
                             .values(state=REQUEUED, owner_node=None, incarnation=None,
                                     owner_pid=None, lease_expires_at=now + hold,
                                     updated_at=now))
                log.warning("work %s requeued: its execution ended without an outcome%s", key,
                            f"; its re-sent copy has {hold:.0f}s to take it" if hold else "",
                            extra={"action": "let_go", "work_key": key})
        return len(out.lapse) + len(out.let_go)

    @guarded
    def release_reserved(self, owner: Owner) -> int:
        """Let go of ``owner``'s reserved claims and the claims it took but never saw start
        (work received, not started): other workers' sweeps re-publish them. For a worker
        cut off from its broker (which first voids the claims it handed to its pool:
        ``tasks.handed_claims.void_all``)."""
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
        choice = (
            select(w.c.work_key, w.c.task_id, w.c.task_name, w.c.message_json, w.c.state,
                   w.c.owner_node, w.c.owner_pid, w.c.deaths, w.c.republished, w.c.retries,
                   revoked)
            # a claim handed to a replacement waits for it (Celery sends it)
            .where(w.c.state.in_(OPEN_STATES), gone, w.c.handed_to.is_(None))
            .limit(limit)
            .with_for_update(**self.dialect.lock_of(w), **self.dialect.lock_kwargs()))
        if self.dialect.is_mysql:
            # InnoDB locks every row a sort reads before the LIMIT: ordered by creation
            # (a filesort), one sweep would lock all the orphans and a concurrent one find
            # none. Walking the (state, lease) index in its order, it locks only the rows
            # it takes, and the other sweep takes the next ones, as on PostgreSQL.
            index = f"ix_{self.prefix}work_state_lease"
            choice = choice.order_by(w.c.state, w.c.lease_expires_at)
            for name in ("mysql", "mariadb"):
                choice = choice.with_hint(w, f"FORCE INDEX ({index})", name)
        else:
            choice = choice.order_by(w.c.created_at)
        with self.begin() as conn:
            rows = conn.execute(choice).all()
            orphans: list[Orphan] = []
            for r in rows:
                fate = judge_orphan(r.state, r.owner_pid, r.republished, bool(r.revoked),
                                    hold_seconds, max_republish, max_hold_seconds)
                if fate.end_state is not None:
                    self._end(conn, r.work_key, fate.end_state, deaths=r.deaths + fate.death,
                              error=fate.reason)
                    if ended is not None:
                        ended.append(Ended(r.work_key, r.task_id, r.task_name, fate.end_state,
                                           fate.reason))
                    if fate.end_state == DEAD:
                        log.error("work %s parked dead: re-published %d times without "
                                  "starting", r.work_key, r.republished,
                                  extra={"action": "dead", "work_key": r.work_key})
                    continue
                conn.execute(update(w).where(w.c.work_key == r.work_key).values(
                    state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
                    lease_expires_at=now + fate.hold, republished=w.c.republished + 1,
                    deaths=w.c.deaths + fate.death, updated_at=now,
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
