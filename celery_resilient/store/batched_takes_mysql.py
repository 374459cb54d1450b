"""Batched takes on MySQL and MariaDB (see :mod:`.batched_takes` for what a batch takes).

No ``UPDATE ... FROM`` over a JSON set with ``RETURNING``, as on PostgreSQL: a batch is one
transaction of single-row statements, as on SQLite, but on a server, so each is a round
trip. Per take: the UPDATE of a takeable row and the read of the row it locked (its epoch
and checkpoint), or, for a key with no row, one INSERT whose new epoch comes back in the
reply's insert-id field (``LAST_INSERT_ID(expr)``); a key another delivery inserted first
is refused by its primary key and left to the careful take. The conditions are those of
:mod:`.batched_takes`, which the batched-takes tests check on every dialect.

Results are not group-committed here (``finishes``): as on SQLite, each pool process
finishes its own work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from celery_resilient.core.states import REQUEUED, RESERVED, RUNNING, UNSTARTED_PID
from celery_resilient.errors import PayloadTooLarge
from celery_resilient.store import packet_limit
from celery_resilient.store.batched_takes import (
    TAKEN_COLUMNS,
    Finish,
    Started,
    TakeRequest,
    take_params,
)
from celery_resilient.store.dialect import ER_DUP_ENTRY, Dialect


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
            f"WHERE NOT EXISTS (SELECT 1 FROM {rv} r WHERE r.task_id = %(task_id)s)")

    def run(self, conn: Connection, takes: Sequence[TakeRequest], started: Sequence[Started],
            node: str, inc: str, lease: float, max_attempts: int,
            finishes: Sequence[Finish] = (), deferred: list[Started] | None = None,
            ) -> tuple[list[dict[str, Any]], set[str]]:
        """As :meth:`.batched_takes.BatchedTakes.run`; ``conn`` is inside a transaction the
        caller commits. ``finishes`` are refused (PostgreSQL only). A mark whose row another
        transaction holds is not written but appended to ``deferred``."""
        if finishes:
            raise ValueError("finishes are committed by the main process on PostgreSQL only")
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        errors = conn.dialect.loaded_dbapi
        try:
            for s in self._lock_marked(cursor, started, deferred):
                cursor.execute(self.started if s.pid is not None else self.lost,
                               {"key": s.work_key, "epoch": s.epoch, "pid": s.pid, "inc": inc})
            rows: list[dict[str, Any]] = []
            for t in takes:
                params = take_params(t, node, inc, lease, max_attempts)
                if cursor.execute(self.update, params) == 1:
                    cursor.execute(self.taken, params)
                    row = cursor.fetchone()
                    assert row is not None  # locked by this transaction's UPDATE
                    rows.append(dict(zip(TAKEN_COLUMNS, row, strict=True)))
                    continue
                try:
                    # the driver's cursor: no listener checks the message's size
                    packet_limit.enforce(conn, self.insert, params)
                except PayloadTooLarge:
                    continue  # its pool process's careful take refuses it, by name
                try:
                    inserted = cursor.execute(self.insert, params)
                except errors.IntegrityError as exc:
                    if exc.args[0] == ER_DUP_ENTRY:
                        continue  # a row the careful take must judge
                    raise
                if inserted == 1:
                    rows.append(dict(zip(TAKEN_COLUMNS, (
                        t.work_key, int(cursor.lastrowid), 1, 0, None, 0, None, 0, None, None),
                        strict=True)))
            return rows, set()
        finally:
            cursor.close()

    def _lock_marked(self, cursor: Any, started: Sequence[Started],
                     deferred: list[Started] | None) -> list[Started]:
        """The marks whose rows this transaction could lock at once (now locked); those of
        rows another transaction holds go to ``deferred``, those of rows gone are dropped."""
        if not started:
            return []
        keys = tuple({s.work_key for s in started})
        cursor.execute(self.lock_marked, {"keys": keys})
        locked = {row[0] for row in cursor.fetchall()}
        if len(locked) < len(keys):
            cursor.execute(self.existing, {"keys": keys})
            held = {row[0] for row in cursor.fetchall()} - locked
            if deferred is not None:
                deferred.extend(s for s in started if s.work_key in held)
        return [s for s in started if s.work_key in locked]
