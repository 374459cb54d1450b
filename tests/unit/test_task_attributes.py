"""A resumable task's run-time attributes outside a run: absent, as Python tools expect."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.errors import NotRunning, ResilientError


def _task(tmp_path: Path) -> ResumableTask:
    app = Celery("attrs", set_as_current=False)
    app.conf.resilient_store_url = f"sqlite:///{tmp_path}/s.sqlite3"
    Resilient(app)

    @app.task(base=ResumableTask, bind=True, shared=False, name="attrs.t")
    def t(self: ResumableTask) -> int:
        return 1

    return t  # type: ignore[return-value]


def test_outside_a_run_the_attributes_are_absent_not_broken(tmp_path: Path) -> None:
    task = _task(tmp_path)
    for name in ("attempt", "checkpoint", "work_key", "fencing_token"):
        assert not hasattr(task, name), name
    inspect.getmembers(task)  # used to raise
    with pytest.raises(NotRunning, match="exist only while the task runs") as info:
        _ = task.work_key
    assert isinstance(info.value, ResilientError) and isinstance(info.value, AttributeError)


def test_a_task_may_set_its_own_attempt(tmp_path: Path) -> None:
    """Celery's own integration tasks do; the value set is kept."""
    task = _task(tmp_path)
    task.attempt = 3
    assert task.attempt == 3
