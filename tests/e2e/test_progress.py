"""Checkpoint progress reaches ``AsyncResult.info`` from a real worker, and survives SIGKILL.

Redis broker, Redis result backend, PostgreSQL store, a prefork ``celery worker`` process.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_resilient.testing import EffectLog, wait_for

from .conftest import Project, close_result_client

TOTAL = 4
PAUSE_AT = 2


@pytest.fixture
def backend_url(redis_url: str) -> str:
    return redis_url  # results under celery-task-meta-<unique task id>


@pytest.fixture
def client(redis_url: str, backend_url: str, queue_name: str) -> Iterator[Celery]:
    app = Celery("progress-client", broker=redis_url, backend=backend_url,
                 set_as_current=False)
    app.conf.task_default_queue = queue_name
    yield app
    close_result_client(app)


def _progress(result: AsyncResult) -> Any:
    return result.info if result.state == "PROGRESS" else None


def test_progress_is_visible_through_async_result_and_resumes_after_sigkill(
        make_project: Callable[..., Project], redis_url: str, backend_url: str,
        client: Celery, tmp_path: Path, effect_log: EffectLog) -> None:
    project = make_project(redis_url)
    project.extra = {"result_backend": backend_url}
    env = {**project.env(), "RESILIENT_EXTRA": json.dumps(project.extra)}
    worker = project.nodes.worker("tests.e2e.progressproj", name="progress", concurrency=1,
                                  queues=(project.queue,), env=env)
    gate = tmp_path / "gate"
    # A task id of its own: the backend never lets PROGRESS overwrite an earlier SUCCESS.
    task_id = f"progress-{uuid.uuid4().hex[:12]}"
    result = client.send_task("tests.e2e.progressproj.count", args=(TOTAL, PAUSE_AT, str(gate)),
                              task_id=task_id)

    info = wait_for(lambda: _progress(result) == {"done": PAUSE_AT, "total": TOTAL}
                    and result.info, 60, "PROGRESS 2/4 in the result backend")
    assert info == {"done": PAUSE_AT, "total": TOTAL}
    row = project.store.get_work(task_id)
    assert row is not None and row.state == "running"

    worker.kill("SIGKILL")  # the whole worker, mid-task: the progress stays where it was
    assert AsyncResult(task_id, app=client).info == {"done": PAUSE_AT, "total": TOTAL}
    gate.touch()
    worker.restart()

    final = result.get(timeout=120)
    assert final == {"total": TOTAL, "resumed_from": PAUSE_AT}  # resumed from its checkpoint
    assert result.state == "SUCCESS"
    counts = effect_log.counts()
    assert [counts[f"item:{task_id}:{i}"] for i in range(TOTAL)] == [1, 1, 1, 1]
    row = project.store.get_work(task_id)
    assert row is not None and row.state == "done"
