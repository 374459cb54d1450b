"""Batched takes on MySQL and MariaDB (see :mod:`.batched_takes` for what a batch takes).

No ``UPDATE ... FROM`` over a JSON set with ``RETURNING``, as on PostgreSQL: a batch is one
transaction of single-row statements, as on SQLite, sent as one packet on the autocommitted
session, which takes several statements at once (``CLIENT_MULTI_STATEMENTS``):
``START TRANSACTION``, then per take the UPDATE of a takeable row, the read of the row it
locked (``WHERE ROW_COUNT() = 1``: empty unless the UPDATE matched) and, for a key with no
row at all, one INSERT whose new epoch comes back in the reply's insert-id field
(``LAST_INSERT_ID(expr)``), then ``COMMIT``: one round trip for the batch. Marks come first
and cost one more: the rows they lock must be read with ``SKIP LOCKED`` before the packet
that writes them. A batch over the server's ``max_allowed_packet`` goes in several packets of
one transaction; a take alone over it is left to the careful take, which refuses it by name.

Any error (a key another delivery inserted meanwhile, refused by its primary key, included)
ends the batch: the session, which may hold the open transaction, is dropped
(``Database._autocommitted``), and every delivery goes to its pool process's careful take.
The conditions are those of :mod:`.batched_takes`, which the batched-takes tests check on
every dialect.

Results are not group-committed here (``finishes``): as on SQLite, each pool process
finishes its own work.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from celery_resilient.core.states import REQUEUED, RESERVED, RUNNING, UNSTARTED_PID
from celery_resilient.store import packet_limit
from celery_resilient.store.batched_takes import (
    TAKEN_COLUMNS,
    Finish,
    Started,
    TakeRequest,
    take_params,
)
from celery_resilient.store.dialect import Dialect
from celery_resilient.store.hot_mysql import abandon


class MySQLBatchedTakes:
    """The batch take and the started marks on MySQL (``run`` as
    :meth:`.batched_takes.BatchedTakes.run`)."""

    def __init__(self, t: Any, dialect: Dialect) -> None:
        self.dialect = dialect
        now = str(dialect.now())
        work, rv, old, fg = (t.work.name, t.revocations.name, t.old_checkpoints.name,
                             t.forgotten.name)
        # The marks' rows a transaction holds are skipped (a body's ledger.atomic() holds
        # its row until it commits): the batch must not wait on it with every other
        # delivery's take behind it. The second read tells a held row from a gone one.
        self.lock_marked = (f"SELECT work_key FROM {work} WHERE work_key IN %(keys)s "
                            "FOR UPDATE SKIP LOCKED")
        self.existing = f"SELECT work_key FROM {work} WHERE work_key IN %(keys)s"
        self.started = (
            f"UPDATE {work} SET owner_pid = %(pid)s WHERE work_key = %(key)s "
            f"AND epoch = %(epoch)s AND state = '{RUNNING}' AND owner_pid = {UNSTARTED_PID}")
        self.lost = (
            f"UPDATE {work} SET incarnation = NULL, owner_pid = NULL, lease_expires_at = {now} "
            f"WHERE work_key = %(key)s AND epoch = %(epoch)s AND state = '{RUNNING}' "
            "AND incarnation = %(inc)s")
        # Assignments read only their own column: MySQL assigns left to right.
        self.update = (
            f"UPDATE {work} SET state = '{RUNNING}', epoch = epoch + 1, owner_node = %(node)s, "
            f"incarnation = %(inc)s, owner_pid = {UNSTARTED_PID}, "
            f"lease_expires_at = {now} + %(lease)s, attempts = attempts + 1, "
            "task_id = %(task_id)s, error = NULL, checkpoint_takes = checkpoint_takes + 1, "
            "retries = %(retries)s, handed_to = NULL, "
            f"args_digest = COALESCE(args_digest, %(digest)s), updated_at = {now} "
            f"WHERE work_key = %(key)s AND state IN ('{RESERVED}', '{REQUEUED}') "
            "AND deaths < %(max_attempts)s "
            "AND (args_digest IS NULL OR %(digest)s IS NULL OR args_digest = %(digest)s) "
            "AND retries <= %(retries)s "
            "AND (handed_to IS NULL OR handed_to = %(supersedes)s) "
            f"AND NOT EXISTS (SELECT 1 FROM {rv} r WHERE r.task_id = %(task_id)s)")
        self.taken = (
            "SELECT work_key, epoch, attempts, deaths, checkpoint_json, checkpoint_seq, "
            "checkpoint_epoch, checkpoint_takes, "
            f"(SELECT o.state_json FROM {old} o WHERE o.work_key = %(key)s), "
            f"(SELECT o.seq FROM {old} o WHERE o.work_key = %(key)s) "
            f"FROM {work} WHERE work_key = %(key)s")
        self.insert = (
            f"INSERT INTO {work} (work_key, task_name, task_id, args_digest, state, epoch, "
            "owner_node, incarnation, owner_pid, lease_expires_at, attempts, deaths, "
            "republished, retries, message_json, created_at, updated_at, checkpoint_seq, "
            "checkpoint_takes) "
            f"SELECT %(key)s, %(name)s, %(task_id)s, %(digest)s, '{RUNNING}', "
            "LAST_INSERT_ID(COALESCE("
            f"(SELECT f.epoch FROM {fg} f WHERE f.work_key = %(key)s), 0) + 1), "
            f"%(node)s, %(inc)s, {UNSTARTED_PID}, {now} + %(lease)s, 1, 0, 0, %(retries)s, "
            f"%(message)s, {now}, {now}, 0, 0 FROM DUAL "
            f"WHERE NOT EXISTS (SELECT 1 FROM {work} w WHERE w.work_key = %(key)s) "
            f"AND NOT EXISTS (SELECT 1 FROM {rv} r WHERE r.task_id = %(task_id)s)")
        # The same three per take, each value's name suffixed with the take's index.
        self.trio = "; ".join((self.update, f"{self.taken} AND ROW_COUNT() = 1", self.insert))

    def run(self, conn: Connection, takes: Sequence[TakeRequest], started: Sequence[Started],
            node: str, inc: str, lease: float, max_attempts: int,
            finishes: Sequence[Finish] = (), deferred: list[Started] | None = None,
            ) -> tuple[list[dict[str, Any]], set[str]]:
        """As :meth:`.batched_takes.BatchedTakes.run`; ``conn`` is an autocommitted session
        (``Database.single``), which this call leaves with no transaction open, or raising.
        ``finishes`` are refused (PostgreSQL only). A mark whose row another transaction
        holds is not written but appended to ``deferred``."""
        if finishes:
            raise ValueError("finishes are committed by the main process on PostgreSQL only")
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        try:
            rows = self._run(conn, cursor, takes, started, inc, node, lease, max_attempts,
                             deferred)
        except conn.dialect.loaded_dbapi.Error as exc:  # the session may hold the batch's
            abandon(conn, cursor, exc)                  # open transaction: never lent again
            raise DBAPIError.instance("batched takes", {}, exc, conn.dialect.loaded_dbapi.Error,
                                      connection_invalidated=True,
                                      dialect=conn.dialect) from exc
        except BaseException as exc:
            abandon(conn, cursor, exc if isinstance(exc, Exception) else None)
            raise
        cursor.close()
        return rows, set()

    def _run(self, conn: Connection, cursor: Any, takes: Sequence[TakeRequest],
             started: Sequence[Started], inc: str, node: str, lease: float,
             max_attempts: int, deferred: list[Started] | None) -> list[dict[str, Any]]:
        limit = conn.info.get(packet_limit.INFO_KEY)
        limit = None if limit is None else int(limit)

        def part(sql: str, params: dict[str, Any], statements: int = 1) -> _Part:
            size = 0 if limit is None else packet_limit.size_near(sql, params, limit)
            return _Part(sql, params, statements, size)

        parts = [part("START TRANSACTION", {})]
        if started:  # the transaction begun by the read that locks the marks' rows
            parts = [part(_suffixed_sql(self.started if s.pid is not None else self.lost,
                                        f"m{i}"),
                          _suffixed({"key": s.work_key, "epoch": s.epoch, "pid": s.pid,
                                     "inc": inc}, f"m{i}"))
                     for i, s in enumerate(self._lock_marked(cursor, started, deferred))]
        first = len(parts)  # replies before the takes' trios
        sent: list[TakeRequest] = []
        for t in takes:
            take = part(_suffixed_sql(self.trio, len(sent)),
                        _suffixed(take_params(t, node, inc, lease, max_attempts), len(sent)), 3)
            if limit is not None and take.size > limit:
                continue  # its pool process's careful take refuses it, by name
            parts.append(take)
            sent.append(t)
        parts.append(part("COMMIT", {}))
        replies = _send(cursor, parts, limit)
        rows: list[dict[str, Any]] = []
        for i, t in enumerate(sent):
            (matched, _, _), (_, row, _), (inserted, _, epoch) = (
                replies[first + 3 * i: first + 3 * i + 3])
            if matched == 1:
                assert row is not None  # locked by this transaction's UPDATE
                rows.append(dict(zip(TAKEN_COLUMNS, row, strict=True)))
            elif inserted == 1:
                rows.append(dict(zip(TAKEN_COLUMNS, (
                    t.work_key, epoch, 1, 0, None, 0, None, 0, None, None), strict=True)))
        return rows

    def _lock_marked(self, cursor: Any, started: Sequence[Started],
                     deferred: list[Started] | None) -> list[Started]:
        """Begin the batch's transaction and lock the marks' rows no other transaction holds
        (one round trip); the marks of rows another transaction holds go to ``deferred``,
        those of rows gone are dropped."""
        keys = tuple({s.work_key for s in started})
        cursor.execute(f"START TRANSACTION; {self.lock_marked}; {self.existing}",
                       {"keys": keys})
        cursor.nextset()
        locked = {row[0] for row in cursor.fetchall()}
        cursor.nextset()
        held = {row[0] for row in cursor.fetchall()} - locked
        while cursor.nextset():
            pass
        if deferred is not None:
            deferred.extend(s for s in started if s.work_key in held)
        return [s for s in started if s.work_key in locked]

class _Part(NamedTuple):
    """Statements of a batch's packet: their text, values, how many, and size as sent (0:
    the server's limit unknown)."""

    sql: str
    params: dict[str, Any]
    statements: int
    size: int


def _send(cursor: Any, parts: list[_Part], limit: int | None) -> list[tuple[int, Any, int]]:
    """Send ``parts`` in as few packets as ``limit`` allows (one, unless the batch is over
    it); each statement's reply: its row count, its first row, its insert id."""
    replies: list[tuple[int, Any, int]] = []
    packet: list[_Part] = []

    def flush() -> None:
        values = {k: v for p in packet for k, v in p.params.items()}
        cursor.execute("; ".join(p.sql for p in packet), values)
        for n in range(sum(p.statements for p in packet)):
            if n:
                cursor.nextset()
            row = cursor.fetchone() if cursor.description else None
            replies.append((cursor.rowcount, row, int(cursor.lastrowid or 0)))
        while cursor.nextset():  # (no more: each statement's reply was read)
            pass
        packet.clear()

    size = 0
    for p in parts:
        if packet and limit is not None and size + p.size + 2 > limit:
            flush()
            size = 0
        packet.append(p)
        size += p.size + 2
    flush()
    return replies


def _suffixed(params: dict[str, Any], i: int | str) -> dict[str, Any]:
    return {f"{name}_{i}": value for name, value in params.items()}


@functools.lru_cache(maxsize=256)
def _suffixed_sql(sql: str, i: int | str) -> str:
    """``sql`` with each ``%(name)s`` renamed ``%(name_i)s`` (:func:`_suffixed`'s names)."""
    return _PLACEHOLDER.sub(lambda m: f"%({m.group(1)}_{i})s", sql)


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
