"""Shared fixtures: the real services of this machine, and isolated stores per test.

Services are never faked. A missing service fails the test (``.ci/run`` starts them); it is
not skipped.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from celery_resilient.store.sql import Store
from celery_resilient.testing.services import drop_prefixed_tables

pytest_plugins = ["celery_resilient.testing.plugin"]

PG_URL = os.environ.get("RESILIENT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RESILIENT_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
AMQP_URL = os.environ.get("RESILIENT_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


@pytest.fixture
def pg_url() -> str:
    return PG_URL


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def amqp_url() -> str:
    return AMQP_URL


@pytest.fixture
def table_prefix() -> Iterator[str]:
    """A fresh table prefix, so tests sharing the PostgreSQL database never see each other."""
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    yield prefix
    drop_prefixed_tables(PG_URL, prefix)


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """Parametrises a test over both store dialects (the contract suite)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.sqlite3"
    return PG_URL


@pytest.fixture
def store(store_url: str, table_prefix: str) -> Iterator[Store]:
    s = Store(store_url, table_prefix)
    s.migrate()
    yield s
    s.dispose()


@pytest.fixture
def queue_name() -> str:
    """A queue of this test's own, so tests never consume each other's messages."""
    return f"q-{uuid.uuid4().hex[:10]}"
