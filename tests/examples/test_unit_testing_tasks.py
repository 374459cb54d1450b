"""docs/testing.md's plain pytest example: each test gets its own store.

Both tests apply the task with the same task id; with a shared store the second would get
the first one's stored result without running the body.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_resilient import Resilient
from celery_resilient.testing.plugin import IsolatedStore
from celery_resilient.testing.stores import forget_store

from . import tasks


def charge_once(resilient_store: IsolatedStore) -> None:
    before = len(tasks.charged)
    result = tasks.charge.apply_async(("order-42",), task_id="charge-order-42")
    assert result.get() == "charged order-42"
    assert len(tasks.charged) == before + 1  # the body ran: nothing stored by another test
    assert Resilient.of(tasks.app).config.store_url == resilient_store.url


def test_charge(resilient_store: IsolatedStore) -> None:
    charge_once(resilient_store)


def test_charge_again_with_the_same_task_id(resilient_store: IsolatedStore) -> None:
    charge_once(resilient_store)


def test_a_done_task_id_returns_its_stored_result(resilient_store: IsolatedStore) -> None:
    charge_once(resilient_store)
    runs = len(tasks.charged)
    again = tasks.charge.apply_async(("order-42",), task_id="charge-order-42")
    assert again.get() == "charged order-42"
    assert len(tasks.charged) == runs  # within one test, the store remembers the work
    row = Resilient.of(tasks.app).store.get_work("charge-order-42")
    assert row is not None and row.state == "done"


def test_eager_mode_never_writes_into_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the fixture, an eager app's default store is a temporary file.
    monkeypatch.chdir(tmp_path)
    rt = Resilient.of(tasks.app)
    forget_store(rt)  # resolve the default here, in tmp_path
    assert not rt.config.store_url.endswith("/celery-resilient.sqlite3")
    tasks.charge.apply_async(("order-7",), task_id="charge-order-7").get()
    assert list(tmp_path.iterdir()) == []
    forget_store(rt)
