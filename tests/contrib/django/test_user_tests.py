"""Users' own Django tests: an eager task in a ``TestCase`` uses Django's test database.

The app in ``eagerapp`` loaded its configuration before the test database existed, with the
store derived from the real database. The two tests apply the same task id: each runs the
body (nothing stored by the other), and the real database receives nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.db import connection
from django.test import TestCase
from sqlalchemy import inspect, select
from sqlalchemy.engine import make_url

from celery_resilient import Resilient, ResumableTask
from celery_resilient.contrib.django import configure_from_django
from celery_resilient.contrib.django.testdb import StoreIsolationMixin, empty_store
from celery_resilient.store.sql import Store

from . import eagerapp

TASK_ID = "user-tests-same-id"


class EagerTaskInTestCase(StoreIsolationMixin, TestCase):
    def run_import(self) -> None:
        before = eagerapp.calls.count(TASK_ID)
        result = eagerapp.import_rows.apply_async((7,), task_id=TASK_ID)
        assert result.get() == 7
        assert eagerapp.calls.count(TASK_ID) == before + 1  # the body ran, no stored result

        rt = Resilient.of(eagerapp.app)
        test_db = connection.settings_dict["NAME"]
        assert test_db.startswith("test_resilient_django_")
        assert make_url(rt.config.store_url).database == test_db
        row = rt.store.get_work(TASK_ID)
        assert row is not None and row.state == "done"
        assert_not_in_real_database(TASK_ID)

    def test_first_run_runs_the_body(self) -> None:
        self.run_import()

    def test_second_run_with_the_same_id_runs_the_body_again(self) -> None:
        self.run_import()


def assert_not_in_real_database(task_id: str) -> None:
    real = Store(eagerapp.REAL_STORE_URL, Resilient.of(eagerapp.app).config.table_prefix)
    try:
        assert make_url(eagerapp.REAL_STORE_URL).database == "test"  # from the real name
        if inspect(real.engine).has_table(real.t.work.name):
            with real.engine.connect() as conn:
                rows = conn.execute(select(real.t.work.c.work_key)
                                    .where(real.t.work.c.work_key == task_id)).all()
            assert rows == []
    finally:
        real.dispose()


# -- pytest-django: a test without the database, and per-test isolation -----------------------

def _fresh_eager_app() -> tuple[Celery, Any]:
    """A project app configured from Django's settings now (store URL: the real database)."""
    app = Celery(f"djproj-fresh-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    Resilient(app)
    configure_from_django(app)
    app.conf.update(task_always_eager=True, task_store_eager_result=False)
    ran: list[str] = []

    @app.task(base=ResumableTask, bind=True, shared=False, name="djproj.fresh")
    def fresh(self: ResumableTask, n: int) -> int:
        ran.append(self.request.id)
        self.checkpoint.save({"n": n})
        return n

    fresh.ran = ran  # type: ignore[attr-defined]
    return app, fresh


def test_a_test_without_the_database_never_writes_the_real_one() -> None:
    """No ``db`` fixture: Django never connects to a test database for this test, and the
    store must not use the real one it was configured with."""
    app, fresh = _fresh_eager_app()
    app.conf.resilient_store_url = eagerapp.REAL_STORE_URL  # as loaded before any test DB
    try:
        task_id = f"no-db-{uuid.uuid4().hex[:8]}"
        assert fresh.apply_async((3,), task_id=task_id).get() == 3
        assert fresh.ran == [task_id]
        assert Resilient.of(app).store.url != eagerapp.REAL_STORE_URL
        assert_not_in_real_database(task_id)
    finally:
        Resilient.of(app).forget_store()
        app.close()


@pytest.fixture
def isolated_store(db: Any) -> Iterator[None]:
    """docs/testing.md's pytest-django recipe: empty the store after each test."""
    yield
    empty_store()


@pytest.mark.parametrize("run", [1, 2])
def test_pytest_django_tests_with_one_task_id_each_run_the_body(isolated_store: None,
                                                                run: int) -> None:
    before = eagerapp.calls.count(TASK_ID)
    assert eagerapp.import_rows.apply_async((run,), task_id=TASK_ID).get() == run
    assert eagerapp.calls.count(TASK_ID) == before + 1
    assert_not_in_real_database(TASK_ID)
