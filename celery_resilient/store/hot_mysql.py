"""The hot statements on MySQL and MariaDB, which have no ``UPDATE ... RETURNING``.

The statements are :class:`~.hot.HotStatements`' own (the same fencing conditions, the same
values, one round trip each on ``Database.single``'s autocommitted connection); only the two
that return what they wrote take another form:

- ``take_fast``: ``START TRANSACTION; UPDATE ...; SELECT ... WHERE ROW_COUNT() = 1; COMMIT``
  in one packet (the autocommit engine's sessions accept several statements). The UPDATE
  holds the row's lock until the COMMIT, so the read returns exactly what this take wrote
  (the new epoch, the checkpoint it resumes). Inside a caller's transaction (the careful
  take's) it is the UPDATE, then the read: two round trips, the caller commits.
- ``fenced_checkpoint``: one UPDATE that hands its new ``checkpoint_seq`` back in the reply's
  insert-id field (``checkpoint_seq = LAST_INSERT_ID(checkpoint_seq + 1)``).

Whether a fenced UPDATE matched is its row count: SQLAlchemy's MySQL dialects connect with
``CLIENT_FOUND_ROWS`` (rows matched, not rows changed). Every other hot statement (fence,
close, receipt) runs as written.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, String, bindparam, func, literal_column, select
from sqlalchemy.exc import DBAPIError

from celery_resilient.store import packet_limit
from celery_resilient.store.dialect import Dialect
from celery_resilient.store.hot import HotResult, HotStatements, _instrumented


class MySQLHotStatements(HotStatements):
    """:class:`HotStatements` with the MySQL forms of the statements that return rows."""

    def __init__(self, t: Any, dialect: Dialect) -> None:
        super().__init__(t, dialect)
        w, old = t.work, t.old_checkpoints
        old_row = old.c.work_key == bindparam("k", type_=String)
        self.take_fast_row = select(
            w.c.epoch, w.c.attempts, w.c.deaths, w.c.checkpoint_json, w.c.checkpoint_seq,
            w.c.checkpoint_epoch, w.c.checkpoint_takes,
            select(old.c.state_json).where(old_row).scalar_subquery().label("old_state_json"),
            select(old.c.seq).where(old_row).scalar_subquery().label("old_seq"),
        ).where(w.c.work_key == bindparam("k"))
        self.fenced_checkpoint_seq = self.fenced_checkpoint_update.values(
            checkpoint_seq=func.last_insert_id(w.c.checkpoint_seq + 1))
        self._packets: dict[str, tuple[str, dict[str, Any]]] = {}

    def run(self, conn: Connection, name: str, params: dict[str, Any]) -> HotResult:
        """Run statement ``name`` on ``conn`` (autocommitted, or inside its transaction)."""
        if name == "take_fast":
            if not _autocommits(conn):  # inside the caller's transaction
                return self._take_in_transaction(conn, params)
            if not _instrumented(conn):
                return self._take_in_one_packet(conn, params)
            # Listeners (tracing) see each statement: the same transaction, a trip each.
            try:
                conn.exec_driver_sql("START TRANSACTION")
                res = self._take_in_transaction(conn, params)
                conn.exec_driver_sql("COMMIT")
            except DBAPIError as exc:
                conn.invalidate(exc)  # never lent again with the transaction open
                raise
            return res
        if name == "fenced_checkpoint":
            sql, defaults = self._compiled(conn, name + "_seq", self.fenced_checkpoint_seq)
            cursor = conn.exec_driver_sql(sql, {**defaults, **params})
            if cursor.rowcount != 1:
                return HotResult(cursor.rowcount, None)
            return HotResult(1, SimpleNamespace(checkpoint_seq=int(cursor.lastrowid)))
        return super().run(conn, name, params)

    def _take_in_transaction(self, conn: Connection, params: dict[str, Any]) -> HotResult:
        res = super().run(conn, "take_fast_update", params)
        if res.rowcount != 1:
            return HotResult(res.rowcount, None)
        return HotResult(1, super().run(conn, "take_fast_row", {"k": params["k"]}).row)

    def _take_in_one_packet(self, conn: Connection, params: dict[str, Any]) -> HotResult:
        sql, defaults = self._packet(conn)
        bound = {**defaults, **params}
        packet_limit.enforce(conn, sql, bound)  # the driver's cursor: no listener sees it
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        try:
            cursor.execute(sql, bound)  # START TRANSACTION
            cursor.nextset()  # the UPDATE
            matched = cursor.rowcount
            cursor.nextset()  # the read, empty unless the UPDATE matched
            row = cursor.fetchone()
            cursor.nextset()  # COMMIT
            while cursor.nextset():
                pass
        except conn.dialect.loaded_dbapi.Error as exc:
            # Whatever failed, the session may hold the transaction the packet began, or
            # be mid-reply: it is never lent again (its end rolls back what did not commit).
            abandon(conn, cursor, exc)
            raise DBAPIError.instance(sql, bound, exc, conn.dialect.loaded_dbapi.Error,
                                      connection_invalidated=True,
                                      dialect=conn.dialect) from exc
        except BaseException:  # an interrupt mid-reply (a soft time limit): the same
            abandon(conn, cursor)
            raise
        cursor.close()
        if matched != 1:
            return HotResult(matched, None)
        assert row is not None  # the row this packet's UPDATE locked
        names = ("epoch", "attempts", "deaths", "checkpoint_json", "checkpoint_seq",
                 "checkpoint_epoch", "checkpoint_takes", "old_state_json", "old_seq")
        return HotResult(1, SimpleNamespace(**dict(zip(names, row, strict=True))))

    def _packet(self, conn: Connection) -> tuple[str, dict[str, Any]]:
        """The take's packet, compiled once: its two statements share their parameters."""
        packet = self._packets.get("take_fast")
        if packet is None:
            update_sql, update_params = self._compiled(conn, "take_fast_update",
                                                       self.take_fast_update)
            # ROW_COUNT(): the UPDATE's matched rows (no bound value: the packet's
            # parameters are the UPDATE's, and the read's only one, ``k``, is among them)
            row = self.take_fast_row.where(func.row_count() == literal_column("1"))
            row_sql = str(row.compile(dialect=conn.dialect))
            packet = self._packets["take_fast"] = (
                f"START TRANSACTION; {update_sql}; {row_sql}; COMMIT", update_params)
        return packet


def abandon(conn: Connection, cursor: Any, exc: BaseException | None = None) -> None:
    """Drop ``conn`` after ``exc`` left its driver cursor mid-reply or its session in a
    transaction, then the cursor. In that order, and quietly: mysqlclient's ``close`` of a
    cursor reads what is left of the reply, which on a failed session fails in turn (error
    2006) and would replace the error the caller must see, or wait on a silent server."""
    conn.invalidate(exc)
    with contextlib.suppress(Exception):
        cursor.close()


def _autocommits(conn: Connection) -> bool:
    """Whether ``conn``'s session is in autocommit (a local flag: no round trip)."""
    raw = conn.connection.dbapi_connection
    return bool(raw is not None and raw.get_autocommit())
