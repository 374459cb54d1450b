"""The database system check (``manage.py check --database default``, ``manage.py migrate``)
on a real PostgreSQL store, in process: W001 (no schema), W002 (an older revision), W003 (the
store cannot be read), and silence once the schema is current."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, text

from celery_resilient import Resilient
from celery_resilient.contrib.django.checks import check_store_schema
from celery_resilient.store import migrate as migrations
from celery_resilient.store.sql import Store
from celery_resilient.testing.services import drop_prefixed_tables

from . import celeryapp

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def store_at(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A project app whose store is a fresh prefix in the ``test`` database; the prefix."""
    prefix = f"chk{uuid.uuid4().hex[:8]}_"
    settings.CELERY_RESILIENT_STORE_URL = PG
    settings.CELERY_RESILIENT_TABLE_PREFIX = prefix
    app = Celery("djproj-check", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    Resilient(app)
    monkeypatch.setattr(celeryapp, "app", app)
    yield prefix
    app.close()
    drop_prefixed_tables(PG, prefix)


def _ids(messages: list[Any]) -> list[str]:
    return [m.id for m in messages]


def test_missing_schema_warns_w001_naming_the_store(store_at: str) -> None:
    found = check_store_schema(databases=["default"])
    assert _ids(found) == ["celery_resilient.W001"]
    assert f"(prefix {store_at})" in found[0].msg and "127.0.0.1:5432/test" in found[0].msg
    assert "resilient_migrate" in found[0].hint


def test_older_revision_warns_w002_then_migrate_silences_it(store_at: str) -> None:
    store = Store(PG, store_at)
    try:
        store.migrate()
        head = migrations.head_revision()
        _stamp(store_at, "0002")  # as if a release with an older schema had migrated it
        found = check_store_schema(databases=["default"])
        assert _ids(found) == ["celery_resilient.W002"]
        assert "revision 0002" in found[0].msg and head in found[0].msg
        _stamp(store_at, head)
        assert check_store_schema(databases=["default"]) == []
    finally:
        store.dispose()


def _stamp(prefix: str, revision: str) -> None:
    engine = create_engine(PG)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE {prefix}alembic_version SET version_num = :v"),
                         {"v": revision})
    finally:
        engine.dispose()


def test_unreadable_store_warns_w003(settings: Any, store_at: str) -> None:
    settings.CELERY_RESILIENT_STORE_URL = "postgresql+psycopg://postgres:pw@127.0.0.1:1/none"
    app = Celery("djproj-check-down", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    Resilient(app)
    celeryapp.app = app  # the fixture puts its own app back afterwards
    try:
        found = check_store_schema(databases=["default"])
    finally:
        app.close()
    assert _ids(found) == ["celery_resilient.W003"]
    assert "127.0.0.1:1" in found[0].msg and ":pw@" not in found[0].msg


def test_no_database_checked_means_no_query(store_at: str) -> None:
    assert check_store_schema(databases=None) == []
