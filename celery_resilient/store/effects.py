"""Body effects: checkpoints, steps and the ledger, each write fenced by the execution's
epoch."""

from __future__ import annotations

import logging

from sqlalchemy import (
    Connection,
    select,
    update,
)

from celery_resilient.store.checkpoint_compat import (
    checkpoint_to_resume,
    delete_old_checkpoints,
)
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.records import (
    NO_CHECKPOINT,
)

log = logging.getLogger(__name__)


class BodyEffects(Database):
    """Checkpoints, steps and the ledger, fenced by the execution's epoch."""

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
        with self.reading() as conn:
            value = conn.execute(
                select(s.c.result_json).where(s.c.work_key == work_key, s.c.name == name)
            ).scalar_one_or_none()
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
        ).on_conflict_do_nothing(index_elements=[lg.c.key])
        # Not rowcount: SQLAlchemy 2.1 reports rowcount -1 for INSERTs on psycopg.
        return self.dialect.insert_if_absent(conn, stmt)

    def ledger_set_result(self, conn: Connection, key: str, result_json: str) -> None:
        """Set the result of a marker inserted earlier in ``conn``'s transaction."""
        lg = self.t.ledger
        conn.execute(update(lg).where(lg.c.key == key).values(result_json=result_json))

    @guarded
    def ledger_put(self, key: str, work_key: str | None, epoch: int | None,
                   result_json: str) -> bool:
        with self.begin() as conn:
            return self.ledger_mark(conn, key, work_key, epoch, result_json)
