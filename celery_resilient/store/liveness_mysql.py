"""Proof of death by MySQL/MariaDB session: a named lock held for an incarnation's lifetime.

The analogue of :mod:`.liveness` (read it first): a worker incarnation holds
``GET_LOCK(name, 0)`` on a connection of its own (:class:`MySQLSessionLock`); the server frees
a named lock when the session that took it ends, so another session that can take it has
proof that the incarnation's session is gone. The store marks the incarnation in the same
transaction as it takes the lock (``Store.prove_dead``), and lets the lock go only after
that commit. What differs from PostgreSQL:

- **Named locks are server-wide**, not per database: a holder connected to another database
  of the same server still holds the lock the store's probes see. A holder on another
  server is refused as on PostgreSQL (the store's connection does not see the lock held).
- **A session-level lock, never a transaction's**: the probe takes it on its pooled
  connection and releases it after its transaction commits (a connection lost before that
  ends the session, which frees it).
- **A half-open link**: MySQL has no per-session TCP keepalive settings; the holder sets its
  session's ``wait_timeout`` to ``SERVER_DETECTS_AFTER``, so the server ends a session whose
  client went silent that many seconds after its last ping (it pings every
  ``PING_SECONDS``), the bound the self-fencing guard relies on, as on PostgreSQL.
- **The server start** is the current UTC time less ``Uptime``, both whole seconds (two reads
  may differ by one second), plus a fraction that names the node (its host name, port and
  ``server_id``): named locks are local to one server, also in a cluster (Galera, Group
  Replication), so a probe on another node must never count as a probe of the holder's,
  even if both nodes started within the same second (:func:`same_server`).
- **A pooler** that multiplexes sessions (ProxySQL) pins a session that took a named lock;
  a probe that finds the lock held by its own connection refuses to prove anything, as on
  PostgreSQL.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any

from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from celery_resilient.store import deadlines
from celery_resilient.store.engine import MYSQL_SESSION, utf8mb4_url
from celery_resilient.store.held_session import HeldSession

log = logging.getLogger(__name__)

#: Two reads of one server's start differ by at most this many whole seconds.
SAME_SERVER_WITHIN = 1
#: Distinct node fractions (see :func:`server_start`): two nodes of one cluster share one
#: with a chance of 1 in NODE_FRACTIONS (and then only if they started in the same second).
NODE_FRACTIONS = 997


def lock_name(key: int) -> str:
    """The named lock of an incarnation's key (``liveness.lock_key``; at most 64 chars)."""
    return f"celery-resilient:liveness:{key}"


def same_server(a: float, b: float) -> bool:
    """Whether two :func:`server_start` reads name one start of one node: the same node
    fraction, whole seconds apart by at most ``SAME_SERVER_WITHIN``."""
    apart = abs(a - b)
    return round(apart) <= SAME_SERVER_WITHIN and abs(apart - round(apart)) < 1e-4


def server_start(conn: Connection) -> float:
    """This server's start in whole seconds since the epoch (changes at a restart or
    failover), plus this node's fraction of a second (:data:`NODE_FRACTIONS`)."""
    table = ("information_schema.GLOBAL_STATUS" if getattr(conn.dialect, "is_mariadb", False)
             else "performance_schema.global_status")
    row = conn.exec_driver_sql(
        "SELECT TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP()) "
        f"- VARIABLE_VALUE, @@hostname, @@port, @@server_id "
        f"FROM {table} WHERE VARIABLE_NAME = 'Uptime'").one()
    node = zlib.crc32(f"{row[1]}:{row[2]}:{row[3]}".encode()) % NODE_FRACTIONS
    return float(int(row[0])) + node / 1000


def held_by_this_backend(conn: Connection, key: int) -> bool:
    """Whether this very session holds the lock: a pooler handed us the holder's session."""
    return bool(conn.execute(text("SELECT IS_USED_LOCK(:n) <=> CONNECTION_ID()"),
                             {"n": lock_name(key)}).scalar_one())


def held_in_this_database(conn: Connection, key: int) -> bool:
    """Whether some session of this server holds the lock (named locks are server-wide)."""
    return conn.execute(text("SELECT IS_USED_LOCK(:n)"),
                        {"n": lock_name(key)}).scalar_one() is not None


def try_lock(conn: Connection, key: int) -> bool:
    """Take the lock for this session, if no other session holds it; :func:`release` it."""
    got = conn.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": lock_name(key)}).scalar_one()
    return bool(got == 1)


def release(conn: Connection, key: int) -> None:
    conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": lock_name(key)})


def _connect_args(url: str, deadline: float) -> dict[str, Any]:
    """A connect within 3 s; a reply within ``deadline`` (PyMySQL's socket timeouts)."""
    parsed = make_url(url)
    args: dict[str, Any] = {"connect_timeout": 3, "read_timeout": max(1, round(deadline)),
                            "write_timeout": max(1, round(deadline))}
    return {k: v for k, v in args.items() if k not in parsed.query}


class MySQLSessionLock(HeldSession):
    """This incarnation's liveness lock, on a connection of its own (never pooled); the
    interface of :class:`.liveness.SessionLock`."""

    read_server_start = staticmethod(server_start)

    def __init__(self, url: str, key: int, deadline: float, detects_after: int) -> None:
        super().__init__(url, key, deadline, utf8mb4_url(url), _connect_args(url, deadline))
        self.detects_after = detects_after

    def acquire(self) -> float | None:
        """Open the session and take the lock; the server start, or None if another session
        holds it."""
        self.drop()
        conn = self.engine.connect()
        try:
            with deadlines.bounded(self.deadline):
                deadlines.watch(conn.connection.dbapi_connection)
                conn.exec_driver_sql(MYSQL_SESSION)
                # the server ends this session once it has heard nothing for this long
                conn.exec_driver_sql(f"SET SESSION wait_timeout = {int(self.detects_after)}")
                if not try_lock(conn, self.key):
                    conn.close()
                    return None
                self.server = server_start(conn)
        except Exception:
            conn.close()
            raise
        self._conn = conn
        self.last_ok = time.monotonic()
        return self.server


__all__ = ["SAME_SERVER_WITHIN", "MySQLSessionLock", "held_by_this_backend",
           "held_in_this_database", "lock_name", "release", "same_server", "server_start",
           "try_lock"]
