"""Everything that differs between SQLite, PostgreSQL and MySQL/MariaDB, in one place."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import Connection, Table, literal_column, select
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql import visitors
from sqlalchemy.sql.elements import ClauseElement, ColumnClause, ColumnElement

from celery_resilient.errors import ConfigurationError
from celery_resilient.store.transient import mysql_errno

SUPPORTED = ("sqlite", "postgresql", "mysql")
#: SQLAlchemy names MariaDB ``mariadb`` when the URL says so (``mariadb+pymysql://``); it is
#: the same protocol and SQL as ``mysql`` for everything the store does.
ALIASES = {"mariadb": "mysql"}
#: The oldest servers with ``SKIP LOCKED``.
MIN_MYSQL = (8, 0, 1)
MIN_MARIADB = (10, 6)
#: MySQL's error number for a duplicate key.
ER_DUP_ENTRY = 1062


class Dialect:
    """Dialect-specific SQL: the database clock, upserts and row locking."""

    def __init__(self, name: str) -> None:
        name = ALIASES.get(name, name)
        if name not in SUPPORTED:
            raise ConfigurationError(
                f"resilient_store_url uses the {name!r} dialect; supported: {', '.join(SUPPORTED)}"
            )
        self.name = name

    @property
    def is_sqlite(self) -> bool:
        return self.name == "sqlite"

    @property
    def is_mysql(self) -> bool:
        """MySQL or MariaDB: no ``UPDATE ... RETURNING``, upserts by ``ON DUPLICATE KEY``."""
        return self.name == "mysql"

    @property
    def group_commits(self) -> bool:
        """Whether the worker's main process commits the results its pool processes hand
        over, and defers acknowledgements to a flush (``worker/dispatch/``): PostgreSQL
        only. Elsewhere each pool process finishes its own work (batched takes still
        run: ``store/batched_takes.py``, ``store/batched_takes_mysql.py``)."""
        return self.name == "postgresql"

    def now(self) -> ColumnElement[float]:
        """The database's wall clock in float seconds: leases never trust a worker's clock."""
        if self.is_sqlite:
            return literal_column("((julianday('now') - 2440587.5) * 86400.0)")
        if self.is_mysql:
            # Microseconds from the epoch to UTC_TIMESTAMP(6), as a DOUBLE: independent of
            # the session's time zone (UNIX_TIMESTAMP(NOW(6)) goes through it, and a zone
            # with daylight saving repeats an hour), and valid past 2038-01-19, where
            # UNIX_TIMESTAMP gives NULL on MariaDB before 11.5.
            return literal_column(
                "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) "
                "/ 1000000e0)")
        return literal_column("CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)")

    def insert(self, table: Table) -> Any:
        """An INSERT that supports ``on_conflict_do_update/nothing``.

        On MySQL the PostgreSQL forms are translated to ``ON DUPLICATE KEY UPDATE``
        (:class:`_MySQLInsert`): the store's tables have no unique key but their primary
        key, so "a duplicate key" and "a conflict on ``index_elements``" are the same."""
        if self.is_sqlite:
            return sqlite.insert(table)
        if self.is_mysql:
            return _MySQLInsert(table)
        return postgresql.insert(table)

    def insert_if_absent(self, conn: Connection, stmt: Any,
                         params: dict[str, Any] | None = None) -> bool:
        """Run ``stmt`` (an ``INSERT ... ON CONFLICT DO NOTHING``, one row); True if it
        inserted. One round trip on every dialect: ``RETURNING`` on SQLite and PostgreSQL; on
        MySQL, whose affected-row count cannot tell an insert from a no-op duplicate under
        ``CLIENT_FOUND_ROWS``, the plain INSERT and its duplicate-key error (InnoDB rolls
        back the statement only, never the transaction around it)."""
        if not self.is_mysql:
            return conn.execute(stmt.returning(*stmt.table.primary_key.columns),
                                params).first() is not None
        try:
            conn.execute(stmt.plain(), params)
        except IntegrityError as exc:
            if mysql_errno(exc) == ER_DUP_ENTRY:
                return False
            raise
        return True

    def update_returning(self, conn: Connection, stmt: Any, key: ColumnElement[bool],
                         *columns: Any) -> Any:
        """Run ``stmt`` (an UPDATE of at most one row, whose primary key ``key`` tests) and
        return ``columns`` of the row it changed, or None when it matched none.

        MySQL has no ``UPDATE ... RETURNING``: the row is read back by its key after the
        UPDATE, in the same transaction (``conn`` must be in one, never autocommitted). The
        UPDATE holds the row's lock until commit, so the read sees exactly what this
        statement wrote; two round trips where PostgreSQL needs one."""
        if not self.is_mysql:
            return conn.execute(stmt.returning(*columns)).first()
        if conn.execute(stmt).rowcount != 1:
            return None
        return conn.execute(select(*columns).where(key)).first()

    def chosen(self, conn: Connection, choice: Any) -> Any:
        """What ``column.in_(...)`` gets for the rows a locking ``choice`` selects.

        The subquery itself on PostgreSQL and SQLite (one statement). MySQL refuses a
        ``LIMIT`` in an ``IN`` subquery and a subquery of the table being changed: there the
        choice runs first (its ``FOR UPDATE`` holds the rows until commit, so they still
        match when they are changed) and its values are listed."""
        if not self.is_mysql:
            return choice
        rows = conn.execute(choice).all()
        return [tuple(r) if len(r) > 1 else r[0] for r in rows]

    def lock_kwargs(self) -> dict[str, Any]:
        """Arguments for ``with_for_update`` so concurrent sweepers skip each other's rows."""
        if self.is_sqlite:
            return {}  # SQLite serialises writers with BEGIN IMMEDIATE; FOR UPDATE is ignored
        return {"skip_locked": True}

    def lock_of(self, table: Table) -> dict[str, Any]:
        """``with_for_update(of=...)`` where the dialect has it. MariaDB has no ``OF``, and
        needs none: InnoDB locks the rows of the outer table only, not those a subquery
        reads without a locking clause of its own."""
        return {} if self.is_mysql else {"of": table}


class _MySQLInsert(mysql.Insert):
    """A MySQL INSERT that accepts the PostgreSQL conflict clauses the query modules write.

    ``ON DUPLICATE KEY UPDATE`` assigns left to right and each assignment sees the columns
    already assigned (PostgreSQL's ``DO UPDATE`` sees the old row throughout), so
    :meth:`on_conflict_do_update` assigns a column that other assignments read after them
    (the receipt tests ``state`` in every assignment and also assigns it), and refuses a
    ``set_`` where two assignments read each other's column.
    """

    inherit_cache = True
    #: The INSERT without its conflict clause, set by ``on_conflict_do_nothing``.
    _resilient_plain: Any = None

    @property
    def excluded(self) -> Any:
        """PostgreSQL's name for the row that was proposed: MySQL's ``inserted``."""
        return self.inserted

    def on_conflict_do_nothing(self, index_elements: Any = None) -> Any:
        """A no-op assignment of the first primary-key column: the row is left as it is."""
        key = next(iter(cast(Table, self.table).primary_key.columns))
        stmt = self.on_duplicate_key_update({key.name: key})
        stmt._resilient_plain = self
        return stmt

    def on_conflict_do_update(self, index_elements: Any = None, set_: Any = None,
                              where: Any = None) -> Any:
        if where is not None:
            raise NotImplementedError("ON DUPLICATE KEY UPDATE has no WHERE")
        return self.on_duplicate_key_update(_old_row_first(self.table, dict(set_)))

    def plain(self) -> Any:
        """This INSERT without its conflict clause (``Dialect.insert_if_absent``)."""
        return self if self._resilient_plain is None else self._resilient_plain


def _old_row_first(table: Any, set_: dict[str, Any]) -> list[tuple[str, Any]]:
    """The assignments of ``set_`` in an order where each reads the row as it was."""
    def reads(value: Any) -> set[str]:
        if not isinstance(value, ClauseElement):
            return set()
        return {c.name for c in visitors.iterate(value)
                if isinstance(c, ColumnClause) and c.table is table}

    # x must come before y when x's expression reads y's column (y would be new already)
    before = {y: {x for x in set_ if x != y and y in reads(set_[x])} for y in set_}
    order: list[str] = []
    while len(order) < len(set_):
        ready = [n for n in set_ if n not in order and before[n] <= set(order)]
        if not ready:
            left = sorted(n for n in set_ if n not in order)
            raise ValueError(f"assignments of {', '.join(left)} read each other's column: "
                             "no order gives each the old row on MySQL")
        order.extend(ready)
    return [(n, set_[n]) for n in order]


def check_server(dialect: Any) -> None:
    """Refuse a MySQL or MariaDB server too old for the store (no ``SKIP LOCKED``)."""
    version = tuple(v for v in (dialect.server_version_info or ()) if isinstance(v, int))
    mariadb = bool(getattr(dialect, "is_mariadb", False))
    need = MIN_MARIADB if mariadb else MIN_MYSQL
    if version < need:
        server = "MariaDB" if mariadb else "MySQL"
        raise ConfigurationError(
            f"resilient_store_url names a {server} server of version "
            f"{'.'.join(map(str, version)) or 'unknown'}; the store needs {server} "
            f"{'.'.join(map(str, need))} or later (SKIP LOCKED); upgrade the server or use "
            "PostgreSQL")
