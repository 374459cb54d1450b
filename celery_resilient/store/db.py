"""The store's plumbing, below every query module: engines, dialect, tables, connections and
transactions (``single``, ``reading``, ``begin``), and the fencing rule.

Fencing: each write made on behalf of an execution first "touches" its claim row with a guard
on ``epoch`` and ``state = 'running'`` inside the same transaction. If another execution took
the work over (epoch bumped) the touch matches no row and the whole write is refused with
:class:`StaleClaimError`. On PostgreSQL the touched row stays locked until commit, so a takeover
cannot slip in between the check and the write; on SQLite ``BEGIN IMMEDIATE`` serialises writers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from celery_resilient.core.states import RUNNING, STOPPED_STATES
from celery_resilient.errors import (
    StaleClaimError,
    StoreUnavailable,
    StoreUnreachable,
    WorkStopped,
)
from celery_resilient.store import engine as engine_module
from celery_resilient.store import migrate, transient
from celery_resilient.store.dialect import Dialect
from celery_resilient.store.engine import EngineHolder, for_writing
from celery_resilient.store.guard import drop, guarded, server_gone
from celery_resilient.store.hot import HotStatements
from celery_resilient.store.hot_mysql import MySQLHotStatements
from celery_resilient.store.pinned import PinnedConnection
from celery_resilient.store.schema import build_tables


@contextmanager
def _then(conn: Connection, after: Callable[[Connection], None] | None) -> Iterator[None]:
    try:
        yield
    finally:
        if after is not None and not conn.invalidated:
            try:
                after(conn)
                conn.rollback()
            except DBAPIError:
                drop(conn)  # the session ends, and what it held with it


class Database:
    """One store's engines, dialect and tables, its connections and transactions, and the
    fencing rule every write on behalf of an execution follows."""

    def __init__(self, url: str, table_prefix: str = "resilient_") -> None:
        self.url = url
        self.prefix = table_prefix
        self._engine = EngineHolder(url)
        self._autocommit = EngineHolder(url, autocommit=True)  # PostgreSQL: single()
        self.dialect = Dialect(make_url(url).get_backend_name())
        self.t = build_tables(table_prefix)
        self._hot = (MySQLHotStatements if self.dialect.is_mysql else HotStatements)(
            self.t, self.dialect)
        # PostgreSQL through psycopg: single statements on a kept connection when it is free
        self._pinned = (PinnedConnection() if make_url(url).get_driver_name() == "psycopg"
                        else None)

    # -- plumbing -------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._engine.get()

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine of this store, for instrumentation: the transactional one and, on
        PostgreSQL, the autocommit one single statements use (take, finish, heartbeat)."""
        if self.dialect.is_sqlite:
            return (self.engine,)
        return (self.engine, self._autocommit.get())

    def dispose(self) -> None:
        if self._pinned is not None:
            self._pinned.discard()
        self._engine.dispose()
        self._autocommit.dispose()

    @guarded
    def _connect(self) -> Connection:
        """A connection with its transaction begun: an unreachable store is StoreUnavailable."""
        conn = for_writing(self.engine.connect())
        try:
            conn.begin()
        except BaseException:
            conn.close()
            raise
        return conn

    def single(self) -> AbstractContextManager[Connection]:
        """A connection for exactly one atomic write statement.

        On PostgreSQL and MySQL it runs in autocommit: the statement is its own transaction,
        one round trip instead of three (statement, then COMMIT; no separate BEGIN). On
        MySQL a statement that returns what it wrote is sent with the read of its row inside
        a transaction of its own, in the same packet (:mod:`.hot_mysql`); any other write
        that reads back must use :meth:`begin`. SQLite takes the normal writing transaction.
        """
        return self.begin() if self.dialect.is_sqlite else self._autocommitted()

    @contextmanager
    def reading(self) -> Iterator[Connection]:
        """A connection for one read: autocommitted on PostgreSQL (one round trip, not
        BEGIN, SELECT, ROLLBACK); SQLite's read transaction is local and ended here."""
        if self.dialect.is_sqlite:
            with self.engine.connect() as conn:
                yield conn
                conn.rollback()
            return
        with self._autocommitted() as conn:
            yield conn

    @contextmanager
    def _autocommitted(self) -> Iterator[Connection]:
        engine = self._autocommit.get()
        if self._pinned is not None:
            with self._pinned.lend(engine) as kept:
                if kept is not None:
                    try:
                        yield kept
                    except BaseException as exc:
                        if server_gone(exc):
                            drop(kept)
                        raise
                    return
        with engine.connect() as conn:  # connections stay in autocommit
            try:
                yield conn
            except BaseException as exc:
                # (One an interrupt left mid-statement is refused at its next checkout:
                # engine._refuse_unfinished.) MySQL's pool sends no rollback and has no
                # such check: a connection that raised anything may be mid-reply, or hold a
                # transaction a statement began (hot_mysql), and is never lent again.
                if server_gone(exc) or self.dialect.is_mysql:
                    drop(conn)
                raise

    @contextmanager
    def begin(self, after: Callable[[Connection], None] | None = None
              ) -> Iterator[Connection]:
        """One transaction; also used for the user's own writes (``Ledger.atomic``).

        ``after(conn)`` runs on the same session once the transaction ended, committed or
        not (a MySQL named lock taken inside it is released there: it is the session's,
        not the transaction's); a connection lost by then ended the session anyway.

        A failure at COMMIT has an unknown outcome (the commit may have landed before the
        reply was lost): a transient or connection error there is :class:`StoreUnavailable`,
        never re-run. Each commit is counted, so ``guarded`` never re-runs a call that
        already committed a transaction.
        """
        conn = self._connect()
        with conn, _then(conn, after):
            try:
                yield conn
            except BaseException as exc:
                try:
                    conn.rollback()
                except DBAPIError:
                    # Interrupted mid-statement (a soft time limit: "another command is
                    # already in progress"; the pool refuses that connection at its next
                    # checkout): the error that stopped the transaction is what the caller
                    # must see, not the rollback's.
                    raise exc from None
                if server_gone(exc):
                    drop(conn)
                raise
            try:
                conn.commit()
            except DBAPIError as exc:
                if isinstance(exc, OperationalError) or transient.is_transient(exc):
                    lost = exc.connection_invalidated or server_gone(exc)
                    raise (StoreUnreachable if lost else StoreUnavailable)(
                        f"store {'connection lost' if lost else 'unavailable'} at commit of "
                        f"{transient.current_operation('a transaction')}, outcome unknown "
                        f"({transient.describe(exc)}): {exc.orig}") from exc
                raise
            transient.note_commit()
        # a soft time limit the pool's reset of this connection met (and SQLAlchemy hid)
        engine_module.raise_swallowed_interrupt()

    @guarded
    def ensure_schema(self, migrate_if_needed: bool) -> None:
        migrate.check(self.engine, self.prefix, migrate_if_needed)

    @guarded
    def migrate(self) -> None:
        migrate.upgrade(self.engine, self.prefix)

    @guarded
    def now(self) -> float:
        with self.engine.connect() as conn:
            value = conn.execute(select(self.dialect.now())).scalar_one()
            conn.rollback()
        return float(value)

    def _first_epoch(self, work_key: str) -> Any:
        """Epoch 0 for a new key, or the last epoch of the key's forgotten predecessor."""
        fg = self.t.forgotten
        return func.coalesce(
            select(fg.c.epoch).where(fg.c.work_key == work_key).scalar_subquery(), 0)

    def fence(self, conn: Connection, work_key: str, epoch: int) -> None:
        """Refuse the transaction unless ``epoch`` still holds the running claim."""
        res = self._hot.run(conn, "fence", {"k": work_key, "e": epoch})
        if res.rowcount != 1:
            raise self._refused(work_key, epoch, "write refused")

    def _refused(self, work_key: str, epoch: int, what: str) -> StaleClaimError:
        """Why a fenced write matched no row: superseded, or stopped by a cancel or revoke."""
        w = self.t.work
        try:
            with self.engine.connect() as conn:
                row = conn.execute(select(w.c.state, w.c.epoch).where(
                    w.c.work_key == work_key)).first()
                conn.rollback()
        except DBAPIError:
            row = None
        if row is not None and row.state in STOPPED_STATES and int(row.epoch) == epoch:
            return WorkStopped(f"work {work_key!r} was {row.state} while epoch {epoch} ran; "
                               f"{what}")
        return StaleClaimError(f"claim on work {work_key!r} at epoch {epoch} was superseded; "
                               f"{what}")

    @guarded
    def assert_current(self, work_key: str, epoch: int) -> None:
        """Raise :class:`StaleClaimError` unless ``epoch`` still holds the running claim."""
        w = self.t.work
        with self.engine.connect() as conn:
            row = conn.execute(select(w.c.epoch, w.c.state).where(w.c.work_key == work_key)).first()
            conn.rollback()
        if row is None or row.epoch != epoch or row.state != RUNNING:
            raise self._refused(work_key, epoch, "effect not started")

    def ended(self, state: str, error: str) -> dict[str, Any]:
        """The column values of every transition to a terminal ``state`` but ``done``."""
        now = self.dialect.now()
        return {"state": state, "error": error[:4000], "owner_pid": None,
                "lease_expires_at": None, "updated_at": now, "finished_at": now}

    def _end(self, conn: Connection, work_key: str, state: str, error: str,
             deaths: Any = None) -> None:
        """Move ``work_key`` to a terminal ``state`` inside ``conn``'s transaction."""
        w = self.t.work
        conn.execute(update(w).where(w.c.work_key == work_key).values(
            **self.ended(state, error), deaths=w.c.deaths if deaths is None else deaths))
