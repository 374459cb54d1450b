"""Proof of death by PostgreSQL session: an advisory lock held for an incarnation's lifetime.
(MySQL and MariaDB: a named lock, :mod:`.liveness_mysql`.)

PostgreSQL frees a session-level advisory lock when the session ends: a few milliseconds after
its holder's process dies, on any host; after TCP keepalives give up when the holder's link is
cut. A worker incarnation holds ``pg_advisory_lock(CLASS_ID, key)`` on a connection of its own
(:class:`SessionLock`), so another session that can take that lock has proof that the
incarnation's session is gone. The store marks it stopped in the same transaction as it takes
the lock (``Store.prove_dead``), so no successor acts on a proof the holder could contest.

What the proof rests on, and what it does not cover:

- **A server restart or failover frees every lock.** The holder records which server start it
  took its lock on (``workers.liveness_server``); a lock taken on another server start proves
  nothing, and the incarnation is judged by its lease.
- **A half-open link.** The holder's session GUCs (``tcp_keepalives_*``) make the server end the
  session of a client that stopped answering within about ``SERVER_DETECTS_AFTER`` seconds; the
  holder pings its session every ``PING_SECONDS`` with a ``tcp_user_timeout`` short enough to
  notice a cut first, and stops its executions before the server could free its lock
  (self-fencing, :mod:`celery_resilient.worker.liveness_session`). A link that stays open
  and answers nothing (a stalled proxy, a frozen server) fails each round trip after
  ``PING_DEADLINE`` (:mod:`.deadlines`), whatever TCP says.
- **A pooler in transaction mode** (PgBouncer) cannot carry a session: the lock would stay on
  a server connection other clients reuse, where a re-entrant acquisition by another client
  would look like a proof. ``resilient_liveness_url`` names a direct connection; a probe that
  finds the lock held by its own backend refuses to prove anything.
- **A frozen holder** (SIGSTOP, a paused VM) keeps its session: its kernel still answers TCP.
  No proof; its lease expires as before and epochs fence it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from celery_resilient.store import deadlines
from celery_resilient.store.held_session import HeldSession
from celery_resilient.store.liveness_mysql import MySQLSessionLock

log = logging.getLogger(__name__)

#: The first key of every liveness lock ("RESI"): the two-integer advisory key space, apart
#: from the single-bigint one the migrations use.
CLASS_ID = 0x52455349
#: How often the holder makes a round trip on its session.
PING_SECONDS = 1.0
#: Seconds a round trip on the session may go unanswered: a link that stays open and
#: answers nothing (a stalled proxy, a frozen server) is lost after this, whatever TCP says.
PING_DEADLINE = 2.0
#: Client side: sent data unacknowledged this long (ms) ends the holder's connection.
CLIENT_TCP_USER_TIMEOUT_MS = 3000
#: Server side, per session: a silent client is declared gone after idle + interval x count.
SERVER_KEEPALIVES = {"tcp_keepalives_idle": 5, "tcp_keepalives_interval": 2,
                     "tcp_keepalives_count": 3}
SERVER_DETECTS_AFTER = 5 + 2 * 3


def lock_key(prefix: str, incarnation: str) -> int:
    """The second key of an incarnation's lock (a signed 32-bit integer).

    Two incarnations that happen to share a key are both safe: the second cannot take its
    lock and runs without one (judged by its lease), and a probe of one finds the lock held
    by the other and proves nothing."""
    digest = hashlib.blake2b(f"{prefix}:{incarnation}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)


def supports(url: str) -> bool:
    return make_url(url).get_backend_name() in ("postgresql", "mysql", "mariadb")


def session_lock(url: str, prefix: str, incarnation: str,
                 deadline: float = PING_DEADLINE) -> SessionLock | MySQLSessionLock:
    """The liveness lock of ``incarnation`` for the server ``url`` names (PostgreSQL's
    advisory lock, or MySQL's named lock: :mod:`.liveness_mysql`)."""
    if make_url(url).get_backend_name() in ("mysql", "mariadb"):
        return MySQLSessionLock(url, lock_key(prefix, incarnation), deadline,
                                SERVER_DETECTS_AFTER)
    return SessionLock(url, prefix, incarnation, deadline)


def server_start(conn: Connection) -> float:
    """This server's start, in seconds since the epoch (changes at a restart or failover)."""
    return float(conn.exec_driver_sql(
        "SELECT EXTRACT(EPOCH FROM pg_postmaster_start_time())").scalar_one())


def same_server(a: float, b: float) -> bool:
    """Whether two reads of :func:`server_start` name the same start."""
    return abs(a - b) < 1e-3


def held_by_this_backend(conn: Connection, key: int) -> bool:
    """Whether this very backend holds the lock: a pooler handed us the holder's session."""
    return bool(conn.execute(text(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid::int = :c AND objid::int = :k AND objsubid = 2 "
        "AND pid = pg_backend_pid())"), {"c": CLASS_ID, "k": key}).scalar_one())


def held_in_this_database(conn: Connection, key: int) -> bool:
    """Whether some session of this server holds the lock in this connection's database.
    Advisory locks are per database: a holder connected to another database (or server)
    holds a lock this database's probes can always take, a false proof of death."""
    return bool(conn.execute(text(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid::int = :c AND objid::int = :k AND objsubid = 2 AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()))"),
        {"c": CLASS_ID, "k": key}).scalar_one())


def try_lock_for_transaction(conn: Connection, key: int) -> bool:
    """Take the lock until this transaction ends, if no other session holds it."""
    return bool(conn.execute(text("SELECT pg_try_advisory_xact_lock(:c, :k)"),
                             {"c": CLASS_ID, "k": key}).scalar_one())


def _connect_args(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    args: dict[str, Any] = {"connect_timeout": 3, "keepalives": 1, "keepalives_idle": 1,
                            "keepalives_interval": 1, "keepalives_count": 2,
                            "tcp_user_timeout": CLIENT_TCP_USER_TIMEOUT_MS}
    for name in list(args):
        if name in parsed.query:
            del args[name]
    if parsed.get_driver_name() == "psycopg":
        args["prepare_threshold"] = None
    return args


class SessionLock(HeldSession):
    """This incarnation's liveness lock, on a connection of its own (never pooled)."""

    read_server_start = staticmethod(server_start)

    def __init__(self, url: str, prefix: str, incarnation: str,
                 deadline: float = PING_DEADLINE) -> None:
        super().__init__(url, lock_key(prefix, incarnation), deadline, url, _connect_args(url))

    def acquire(self) -> float | None:
        """Open the session and take the lock; the server start, or None if another session
        holds it (a probe of this very moment, or a key shared with another incarnation)."""
        self.drop()
        conn = self.engine.connect()  # bounded by connect_timeout
        try:
            with deadlines.bounded(self.deadline):
                deadlines.watch(conn.connection.dbapi_connection)
                for name, value in SERVER_KEEPALIVES.items():
                    conn.exec_driver_sql(f"SET {name} = {int(value)}")
                got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:c, :k)"),
                                        {"c": CLASS_ID, "k": self.key}).scalar_one())
                if not got:
                    conn.close()
                    return None
                self.server = server_start(conn)
        except Exception:
            conn.close()
            raise
        self._conn = conn
        self.last_ok = time.monotonic()
        return self.server


__all__ = ["CLASS_ID", "PING_SECONDS", "SERVER_DETECTS_AFTER", "SessionLock",
           "held_by_this_backend", "lock_key", "same_server", "server_start", "session_lock",
           "supports", "try_lock_for_transaction"]
