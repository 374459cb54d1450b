"""The hot statements on MySQL and MariaDB, which have no ``UPDATE ... RETURNING``.

The statements are :class:`~.hot.HotStatements`' own (the same fencing conditions, the same
values); only the two that return what they wrote take another form, inside the one
transaction ``Database.single`` opens on MySQL:

- ``take_fast``: the UPDATE, then a read of the row by its key. The UPDATE holds the row's
  lock until commit, so the read returns exactly what this take wrote (the new epoch, the
  checkpoint it resumes). Three round trips (UPDATE, SELECT, COMMIT) where PostgreSQL needs
  one.
- ``fenced_checkpoint``: one UPDATE that hands its new ``checkpoint_seq`` back in the reply's
  insert-id field (``checkpoint_seq = LAST_INSERT_ID(checkpoint_seq + 1)``), then COMMIT.
  Whether the fence held is the matched-row count (SQLAlchemy's MySQL dialects connect with
  ``CLIENT_FOUND_ROWS``: rows matched, not rows changed).

Every other hot statement (fence, close, receipt) runs as written.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sqlalchemy import Connection, String, bindparam, func, select

from celery_resilient.store.dialect import Dialect
from celery_resilient.store.hot import HotResult, HotStatements


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

    def run(self, conn: Connection, name: str, params: dict[str, Any]) -> HotResult:
        """Run statement ``name`` on ``conn``, which is inside a transaction."""
        if name == "take_fast":
            res = super().run(conn, "take_fast_update", params)
            if res.rowcount != 1:
                return HotResult(res.rowcount, None)
            return HotResult(1, super().run(conn, "take_fast_row", {"k": params["k"]}).row)
        if name == "fenced_checkpoint":
            sql, defaults = self._compiled(conn, name + "_seq", self.fenced_checkpoint_seq)
            cursor = conn.exec_driver_sql(sql, {**defaults, **params})
            if cursor.rowcount != 1:
                return HotResult(cursor.rowcount, None)
            return HotResult(1, SimpleNamespace(checkpoint_seq=int(cursor.lastrowid)))
        return super().run(conn, name, params)
