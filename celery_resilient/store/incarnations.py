"""Incarnations: one lease row per worker start, its heartbeat, and the proofs that one is gone
(its process, its liveness session, a successor's start)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from sqlalchemy import (
    func,
    select,
    update,
)

from celery_resilient.core.identity import Owner
from celery_resilient.store import liveness, liveness_mysql
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.records import (
    ENDED_PROCESS,
    ENDED_SESSION,
    ENDED_SUCCESSOR,
    PROVEN_DEAD,
    SESSION_ALIVE,
    UNJUDGED,
    GoneIncarnations,
    IncarnationRow,
    LiveBroker,
)

log = logging.getLogger(__name__)


class Incarnations(Database):
    """Worker incarnations: leases, heartbeats, liveness sessions, proofs of death."""

    @property
    def _sessions(self) -> ModuleType:
        """The liveness-lock queries of this store's server: :mod:`.liveness` (PostgreSQL)
        or :mod:`.liveness_mysql`, each with ``server_start``, ``same_server``,
        ``held_by_this_backend`` and ``held_in_this_database``."""
        return liveness_mysql if self.dialect.is_mysql else liveness

    # -- incarnations: one lease row per worker start ------------------------------------

    @guarded
    def register(self, owner: Owner, process: str, lease_seconds: float,
                 broker: str | None = None) -> None:
        """Record this worker incarnation with its first lease and its broker (worker
        start; ``broker`` as :meth:`BrokerIdentity.dumps
        <celery_resilient.broker.identity.BrokerIdentity.dumps>` writes it)."""
        wk = self.t.workers
        now = self.dialect.now()
        ins = self.dialect.insert(wk).values(
            incarnation=owner.incarnation, node=owner.node, pid=owner.pid, process=process,
            started_at=now, heartbeat_at=now, lease_expires_at=now + lease_seconds,
            broker=broker)
        with self.begin() as conn:
            conn.execute(ins.on_conflict_do_update(
                index_elements=[wk.c.incarnation],
                set_={"heartbeat_at": now, "lease_expires_at": now + lease_seconds,
                      "process": process, "broker": broker}))

    @guarded
    def record_broker(self, owner: Owner, broker: str) -> None:
        """Replace the broker this incarnation recorded (its marker's token changed)."""
        wk = self.t.workers
        with self.single() as conn:
            conn.execute(update(wk).where(wk.c.incarnation == owner.incarnation)
                         .values(broker=broker))

    @guarded
    def live_brokers(self, owner: Owner) -> list[LiveBroker]:
        """The brokers the other live incarnations of this store recorded (not stopped,
        lease not expired; an earlier version's, which recorded none, left out)."""
        wk = self.t.workers
        now = self.dialect.now()
        with self.reading() as conn:
            rows = conn.execute(
                select(wk.c.node, wk.c.incarnation, wk.c.broker,
                       (now - wk.c.heartbeat_at).label("renewed_ago"))
                .where(wk.c.incarnation != owner.incarnation, wk.c.stopped_at.is_(None),
                       wk.c.broker.is_not(None), wk.c.lease_expires_at > now)).all()
        return [LiveBroker(r.node, r.incarnation, r.broker, float(r.renewed_ago))
                for r in rows]

    @guarded
    def heartbeat(self, owner: Owner, lease_seconds: float) -> bool:
        """Renew this incarnation's lease: one row, whatever the number of claims.

        The row never waits on a claim row a user's transaction holds (``ledger.atomic``).
        Returns False when another incarnation declared this one dead (its claims are
        being taken over; the caller logs it loudly).
        """
        wk = self.t.workers
        now = self.dialect.now()
        # MySQL: the renewal and the read of its row share a transaction (no RETURNING)
        with (self.begin() if self.dialect.is_mysql else self.single()) as conn:
            this = wk.c.incarnation == owner.incarnation
            stopped = self.dialect.update_returning(
                conn, update(wk).where(this)
                .values(heartbeat_at=now, lease_expires_at=now + lease_seconds),
                this, wk.c.stopped_at)
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
        with self.reading() as conn:
            rows = conn.execute(
                select(wk, self.dialect.now().label("db_now"))
                .where(wk.c.node == owner.node, wk.c.incarnation != owner.incarnation,
                       wk.c.stopped_at.is_(None))).all()
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
        with self.reading() as conn:
            rows = conn.execute(
                select(wk.c.incarnation, wk.c.stopped_at.is_not(None).label("stopped"),
                       (wk.c.ended_by == ENDED_SESSION).label("session_ended"),
                       (lease_end < self.dialect.now()).label("expired"))
                .where(wk.c.incarnation.in_(wanted))).all()
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
        with self.reading() as conn:
            seen = bool(self._sessions.held_in_this_database(
                conn, liveness.lock_key(self.prefix, owner.incarnation)))
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
        (PostgreSQL, MySQL), quiet for ``stale_seconds``."""
        if self.dialect.is_sqlite:
            return []
        wk = self.t.workers
        sessions = self._sessions
        with self.reading() as conn:
            here = sessions.server_start(conn)
            rows = conn.execute(
                select(wk.c.incarnation, wk.c.liveness_server)
                .where(wk.c.incarnation != owner.incarnation, wk.c.stopped_at.is_(None),
                       wk.c.liveness_server.is_not(None), wk.c.ended_by.is_(None),
                       wk.c.lease_expires_at > self.dialect.now(),
                       wk.c.heartbeat_at < self.dialect.now() - stale_seconds)).all()
        return [r.incarnation for r in rows
                if sessions.same_server(float(r.liveness_server), here)]

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
        sessions = self._sessions
        # MySQL: the named lock is the session's; let it go once the proof committed
        after = ((lambda conn: liveness_mysql.release(conn, key)) if self.dialect.is_mysql
                 else None)
        with self.begin(after=after) as conn:
            row = conn.execute(select(wk.c.liveness_server, wk.c.stopped_at, wk.c.node)
                               .where(wk.c.incarnation == incarnation)
                               .with_for_update()).first()
            if row is None or row.stopped_at is not None or row.liveness_server is None:
                return UNJUDGED
            if not sessions.same_server(float(row.liveness_server),
                                        sessions.server_start(conn)):
                return UNJUDGED  # taken on a server that has restarted since: no proof
            if sessions.held_by_this_backend(conn, key):
                log.warning("the liveness lock of incarnation %s is held by this very "
                            "database session: a pooler in transaction mode? Set "
                            "resilient_liveness_url to a direct database URL", incarnation,
                            extra={"action": "liveness_pooler"})
                return UNJUDGED
            got = (liveness_mysql.try_lock(conn, key) if self.dialect.is_mysql
                   else liveness.try_lock_for_transaction(conn, key))
            if not got:
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
        with self.reading() as conn:
            if self.dialect.is_mysql:
                value = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'Uptime'").one()[1]
            else:
                value = conn.exec_driver_sql(
                    "SELECT EXTRACT(EPOCH FROM now() - pg_postmaster_start_time())"
                ).scalar_one()
        return float(value)
