"""Users' own Django tests: an eager task in a ``TestCase`` uses Django's test database.

The app in ``eagerapp`` loaded its configuration before the test database existed, with the
store derived from the real database. The two tests apply the same task id: each runs the
body (nothing stored by the other), and the real database receives nothing.
"""

from __future__ import annotations

from django.db import connection
from django.test import TestCase
from sqlalchemy import inspect, select

from celery_resilient import Resilient
from celery_resilient.contrib.django.testdb import StoreIsolationMixin
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
        assert rt.config.store_url.endswith(f"/{test_db}")
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
        assert eagerapp.REAL_STORE_URL.endswith("/test")  # derived from the real name
        if inspect(real.engine).has_table(real.t.work.name):
            with real.engine.connect() as conn:
                rows = conn.execute(select(real.t.work.c.work_key)
                                    .where(real.t.work.c.work_key == task_id)).all()
            assert rows == []
    finally:
        real.dispose()
