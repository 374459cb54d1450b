"""Everything that differs between SQLite and PostgreSQL, in one place."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, literal_column
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.elements import ColumnElement

from celery_resilient.errors import ConfigurationError

SUPPORTED = ("sqlite", "postgresql")


class Dialect:
    """Dialect-specific SQL: the database clock, upserts and row locking."""

    def __init__(self, name: str) -> None:
        if name not in SUPPORTED:
            raise ConfigurationError(
                f"resilient_store_url uses the {name!r} dialect; supported: {', '.join(SUPPORTED)}"
            )
        self.name = name

    @property
    def is_sqlite(self) -> bool:
        return self.name == "sqlite"

    def now(self) -> ColumnElement[float]:
        """The database's wall clock in float seconds: leases never trust a worker's clock."""
        if self.is_sqlite:
            return literal_column("((julianday('now') - 2440587.5) * 86400.0)")
        return literal_column("CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)")

    def insert(self, table: Table) -> Any:
        """An INSERT that supports ``on_conflict_do_update/nothing``."""
        if self.is_sqlite:
            return sqlite.insert(table)
        return postgresql.insert(table)

    def lock_kwargs(self) -> dict[str, Any]:
        """Arguments for ``with_for_update`` so concurrent sweepers skip each other's rows."""
        if self.is_sqlite:
            return {}  # SQLite serialises writers with BEGIN IMMEDIATE; FOR UPDATE is ignored
        return {"skip_locked": True}
