"""Fixtures shared by the integration tests that need PostgreSQL itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine

from celery_resilient.store.sql import Store


@pytest.fixture
def pg_store(pg_url: str, table_prefix: str) -> Iterator[Store]:
    """A migrated PostgreSQL store of the test's own table prefix."""
    s = Store(pg_url, table_prefix)
    s.migrate()
    yield s
    s.dispose()


@pytest.fixture
def other(pg_url: str) -> Iterator[Engine]:
    """Connections of a concurrent client (another worker, the user's own application)."""
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()
