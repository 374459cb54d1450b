"""The statements on every task's path (take, fence, checkpoint save, finish, receipts).

Each is built once as SQLAlchemy Core (no per-call construction or cache keys) and, on
PostgreSQL, compiled once and run on the driver's cursor: per task they are most of the
library's CPU, so what they cost beyond their round trip is kept near zero.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Connection,
    Float,
    Integer,
    String,
    Text,
    bindparam,
    case,
    exists,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError

from celery_resilient.core.states import REQUEUED, RESERVED, RUNNING
from celery_resilient.store import packet_limit
from celery_resilient.store.dialect import Dialect


class HotResult(NamedTuple):
    """What callers of a hot statement read: rows matched, and the first row returned."""

    rowcount: int
    row: Any | None


class HotStatements:
    """Statements on every task's path, built once: no per-call construction or cache keys."""

    def __init__(self, t: Any, dialect: Dialect) -> None:
        self.dialect = dialect
        self._driver_sql: dict[str, tuple[str, dict[str, Any]]] = {}
        #: The statements that return a row (read the row without asking the driver's
        #: description, which builds its columns' objects on every call).
        self._returning: set[str] = set()
        w, rv, old = t.work, t.revocations, t.old_checkpoints
        now = dialect.now()
        # The checkpoint a pre-0005 worker keeps (see Store.load_checkpoint), read with the
        # take so that a body's first load needs no round trip: a primary-key probe of a
        # table that is empty once no such worker runs. Matched on the bound key, not on
        # the updated row's column: SQLite's RETURNING names columns without their table,
        # and `work_key = work_key` would match every row of the old table.
        old_row = old.c.work_key == bindparam("k", type_=String)
        self.take_fast_update = (
            # The common take in one statement: a reserved or requeued claim, compatible
            # arguments, under the death cap, its task id not revoked. Anything else takes
            # the careful path.
            update(w)
            # or_, not in_: an IN list is rendered again on every call
            .where(w.c.work_key == bindparam("k"),
                   or_(w.c.state == RESERVED, w.c.state == REQUEUED),
                   w.c.deaths < bindparam("max_attempts", type_=Integer),
                   or_(w.c.args_digest.is_(None), bindparam("digest", type_=String).is_(None),
                       w.c.args_digest == bindparam("digest", type_=String)),
                   w.c.retries <= bindparam("retries", type_=Integer),
                   # handed back by a replace: only the replacement's message takes it
                   or_(w.c.handed_to.is_(None),
                       w.c.handed_to == bindparam("supersedes", type_=BigInteger)),
                   ~exists().where(rv.c.task_id == bindparam("task_id", type_=String)))
            .values(state=RUNNING, epoch=w.c.epoch + 1, owner_node=bindparam("node"),
                    incarnation=bindparam("inc"), owner_pid=bindparam("pid"),
                    lease_expires_at=now + bindparam("lease", type_=Float),
                    attempts=w.c.attempts + 1, task_id=bindparam("task_id"), error=None,
                    checkpoint_takes=w.c.checkpoint_takes + 1,
                    retries=bindparam("retries", type_=Integer), handed_to=None,
                    args_digest=func.coalesce(w.c.args_digest,
                                              bindparam("digest", type_=String)),
                    updated_at=now)
        )
        self.take_fast = (  # MySQL, which has no UPDATE ... RETURNING: hot_mysql.py
            self.take_fast_update
            .returning(w.c.epoch, w.c.attempts, w.c.deaths, w.c.checkpoint_json,
                       w.c.checkpoint_seq, w.c.checkpoint_epoch, w.c.checkpoint_takes,
                       select(old.c.state_json).where(old_row).scalar_subquery()
                       .label("old_state_json"),
                       select(old.c.seq).where(old_row).scalar_subquery().label("old_seq"))
        )
        self.close = (
            update(w)
            .where(w.c.work_key == bindparam("k"), w.c.epoch == bindparam("e"),
                   w.c.state == RUNNING)
            .values(state=bindparam("state"), result_json=bindparam("result_json"),
                    error=bindparam("error"), owner_pid=None, lease_expires_at=None,
                    updated_at=now, finished_at=now)
        )
        # The same finish, committed without waiting for the WAL flush (PostgreSQL): its
        # worker's main process acknowledges the message only after a commit of its own that
        # does wait (Store.flush), so the result is durable before the ack all the same
        # (worker/dispatch/acks.py). set_config(..., true) is SET LOCAL inside the
        # statement's own transaction: nothing leaks to the session (or, behind a pooler, to
        # another client).
        if not dialect.is_sqlite:
            local_async = select(func.set_config("synchronous_commit", "off", True))
            self.close_unflushed = self.close.where(
                local_async.scalar_subquery().is_not(None))
        self.fence = (
            update(w)
            .where(w.c.work_key == bindparam("k"), w.c.epoch == bindparam("e"),
                   w.c.state == RUNNING)
            .values(updated_at=now)
        )
        # The checkpoint lives in the work row: a save is this one fenced UPDATE, one row
        # written (its SQLite and PostgreSQL forms alike). A checkpoint that changes the state
        # is progress: the crash-loop counter starts again, so a long task interrupted by many
        # deploys while advancing is not poison, while one that dies again and again at the
        # same checkpoint is. ``checkpoint_json`` on the right-hand side is the stored value.
        state = bindparam("state_json", type_=Text)
        progress = w.c.checkpoint_json.is_distinct_from(state)
        self.fenced_checkpoint_update = self.fence.values(
            checkpoint_json=state, checkpoint_seq=w.c.checkpoint_seq + 1,
            checkpoint_epoch=bindparam("e", type_=BigInteger), checkpoint_at=now,
            checkpoint_takes=0,
            deaths=case((progress, 0), else_=w.c.deaths),
            republished=case((progress, 0), else_=w.c.republished),
        )
        self.fenced_checkpoint = self.fenced_checkpoint_update.returning(w.c.checkpoint_seq)
        fg = t.forgotten
        # A key's first row starts at epoch 0, or where its forgotten predecessor ended.
        self.first_epoch = func.coalesce(
            select(fg.c.epoch).where(fg.c.work_key == bindparam("work_key", type_=String))
            .scalar_subquery(), 0)
        ins = dialect.insert(w).values(
            work_key=bindparam("work_key"), task_name=bindparam("task_name"),
            task_id=bindparam("task_id"), args_digest=bindparam("args_digest", type_=String),
            state=RESERVED, epoch=self.first_epoch, owner_node=bindparam("node"),
            incarnation=bindparam("inc"), owner_pid=None,
            lease_expires_at=now + bindparam("lease", type_=Float), attempts=0, deaths=0,
            republished=0, message_json=bindparam("message_json", type_=Text),
            created_at=now, updated_at=now,
        )
        x = ins.excluded
        # No IN (...) here: expanding parameters cannot be used with executemany.
        takeable = or_(w.c.state == RESERVED, w.c.state == REQUEUED)

        def when_takeable(new: Any, old: Any) -> Any:
            return case((takeable, new), else_=old)

        # A reserved or requeued claim becomes reserved by this worker; a running, done,
        # failed or dead one keeps its state and owner. The exact message is always kept.
        self.receipt = ins.on_conflict_do_update(
            index_elements=[w.c.work_key],
            set_={
                "owner_node": when_takeable(x.owner_node, w.c.owner_node),
                "incarnation": when_takeable(x.incarnation, w.c.incarnation),
                "owner_pid": when_takeable(None, w.c.owner_pid),
                "lease_expires_at": when_takeable(x.lease_expires_at, w.c.lease_expires_at),
                "task_id": when_takeable(x.task_id, w.c.task_id),
                "state": when_takeable(RESERVED, w.c.state),
                "message_json": func.coalesce(x.message_json, w.c.message_json),
                "updated_at": x.updated_at,
            },
        )

    def run(self, conn: Connection, name: str, params: dict[str, Any]) -> HotResult:
        """Run statement ``name`` on ``conn`` (autocommitted or inside its transaction).

        On PostgreSQL with psycopg its SQL is compiled once and handed to the driver's cursor
        directly: SQLAlchemy's execution context, cache lookup and result wrapping cost more
        CPU than a fenced write's whole round trip (~0.06 ms of ~0.3 ms per statement), while
        its pool still lends the connection, and a driver error is wrapped exactly as
        SQLAlchemy would wrap it (a broken connection invalidated, ``connection_invalidated``
        set), so :func:`~celery_resilient.store.sql.guarded` treats it the same. An engine
        with cursor or error event listeners (OpenTelemetry, Sentry, a profiler) gets
        SQLAlchemy's own execution instead, so its listeners see every statement.
        """
        statement = getattr(self, name)
        if self.dialect.is_sqlite:
            res = conn.execute(statement, params)
            return HotResult(res.rowcount, res.first() if res.returns_rows else None)
        sql, defaults = self._compiled(conn, name, statement)
        if conn.dialect.driver != "psycopg" or _instrumented(conn):
            res = conn.exec_driver_sql(sql, {**defaults, **params})
            return HotResult(res.rowcount, res.first() if res.returns_rows else None)
        return _on_psycopg(conn, sql, {**defaults, **params}, name in self._returning)

    def _compiled(self, conn: Connection, name: str, statement: Any) -> tuple[str, dict[str, Any]]:
        compiled = self._driver_sql.get(name)
        if compiled is None:
            c = statement.compile(dialect=conn.dialect)
            sql = str(c)
            if "POSTCOMPILE" in sql:  # an expanding IN needs SQLAlchemy at each call
                raise AssertionError(f"hot statement {name} cannot be precompiled: {sql}")
            if getattr(c, "effective_returning", None):
                self._returning.add(name)
            compiled = self._driver_sql[name] = (sql, dict(c.params))
        return compiled


def _instrumented(conn: Connection) -> bool:
    """Whether someone listens to this engine's statements or errors (cheap: list checks),
    the store's own packet check aside (its fast paths call it themselves)."""
    return bool(any(fn is not packet_limit.listener
                    for fn in conn.dispatch.before_cursor_execute)
                or conn.dispatch.after_cursor_execute or conn.dialect.dispatch.handle_error)


def _on_psycopg(conn: Connection, sql: str, params: dict[str, Any], returning: bool,
                ) -> HotResult:
    from psycopg.rows import namedtuple_row  # noqa: PLC0415 - psycopg is the optional driver

    raw = conn.connection.dbapi_connection
    assert raw is not None
    cursor = raw.cursor(row_factory=namedtuple_row)
    try:
        cursor.execute(sql, params)
        return HotResult(cursor.rowcount, cursor.fetchone() if returning else None)
    except conn.dialect.loaded_dbapi.Error as exc:
        invalidated = bool(conn.dialect.is_disconnect(exc, raw, cursor))
        if invalidated:
            # As SQLAlchemy does on a disconnect: every connection of the pool opened before
            # now is replaced at its next checkout (the server restarted or ended them all,
            # so the retry must not meet the next dead one), then this one.
            conn.engine.pool._invalidate(conn.connection, exc)
            conn.invalidate(exc)
        raise DBAPIError.instance(sql, params, exc, conn.dialect.loaded_dbapi.Error,
                                  connection_invalidated=invalidated,
                                  dialect=conn.dialect) from exc
    finally:
        cursor.close()
