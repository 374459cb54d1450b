"""A project's own Django tests, run by ``manage.py test --parallel 2`` (test_parallel.py).

Each test process has a clone of the test database; the store must follow the clone of its
own process, and ``StoreIsolationMixin`` must empty that one, so four classes using one task
id each run the body.
"""

from __future__ import annotations

from django.db import connection
from django.test import TestCase

from celery_resilient import Resilient, ResumableTask
from celery_resilient.contrib.django.testdb import StoreIsolationMixin

from .celery import app

app.conf.update(task_always_eager=True, task_store_eager_result=False)
ran: list[str] = []
TASK_ID = "parallel-same-id"


@app.task(base=ResumableTask, bind=True, name="djproj.count")
def count(self: ResumableTask, n: int) -> int:
    ran.append(self.request.id)
    self.checkpoint.save({"n": n})
    return n


class Base(StoreIsolationMixin, TestCase):
    def check_runs_here(self) -> None:
        before = len(ran)
        assert count.apply_async((1,), task_id=TASK_ID).get() == 1
        assert len(ran) == before + 1, "a stored result came back: the store was shared"
        store_db = Resilient.of(app).store.url.rsplit("/", 1)[-1]
        assert store_db == connection.settings_dict["NAME"], (store_db, "follows this clone")


class A(Base):
    def test_a(self) -> None:
        self.check_runs_here()


class B(Base):
    def test_b(self) -> None:
        self.check_runs_here()


class C(Base):
    def test_c(self) -> None:
        self.check_runs_here()


class D(Base):
    def test_d(self) -> None:
        self.check_runs_here()
