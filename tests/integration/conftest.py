"""Fixtures shared by the integration tests that need PostgreSQL or MariaDB itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine

from celery_resilient.store.sql import Store
from celery_resilient.testing.services import drop_prefixed_tables


@pytest.fixture
def pg_store(pg_url: str, table_prefix: str) -> Iterator[Store]:
    """A migrated PostgreSQL store of the test's own table prefix."""
    s = Store(pg_url, table_prefix)
    s.migrate()
    yield s
    s.dispose()


@pytest.fixture
def mysql_store(mysql_url: str, table_prefix: str) -> Iterator[Store]:
    """A migrated store of the test's own table prefix on the machine's MariaDB (its tables
    dropped afterwards: MySQL has no schema per test)."""
    s = Store(mysql_url, table_prefix)
    s.migrate()
    yield s
    s.dispose()
    drop_prefixed_tables(mysql_url, table_prefix)


@pytest.fixture
def other(pg_url: str) -> Iterator[Engine]:
    """Connections of a concurrent client (another worker, the user's own application)."""
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()
