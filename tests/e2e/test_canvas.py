"""Canvas built from resumable tasks on a real worker (Redis broker and result backend):
``self.replace`` with a chord or a group gives the caller what plain Celery gives."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from celery_resilient.testing import EffectLog

from .canvasproj import create_app
from .conftest import Project, close_result_client


@pytest.fixture
def canvas(make_project: Callable[..., Project], redis_url: str) -> Iterator[Celery]:
    project = make_project(redis_url)
    project.nodes.worker("tests.e2e.canvasproj", name="canvas", concurrency=2,
                         queues=(project.queue,), env=project.env())
    app = create_app(project.env())
    app.conf.task_default_queue = project.queue
    yield app
    close_result_client(app)


def test_replace_by_a_chord_gives_the_chords_result(canvas: Celery,
                                                    effect_log: EffectLog) -> None:
    """Celery gives the replaced task's id to the chord's body, a signature nested inside
    the replacement: that body continues the work key (it was refused with WorkKeyConflict
    when only the top level was searched)."""
    result = canvas.tasks["canvas.replace_by_chord"].apply_async()
    assert result.get(timeout=60) == 10
    assert effect_log.count(f"replacer:{result.id}") == 1


def test_replace_by_a_group_gives_the_groups_results(canvas: Celery,
                                                     effect_log: EffectLog) -> None:
    result = canvas.tasks["canvas.replace_by_group"].apply_async()
    assert result.get(timeout=60) == [2, 4]
    assert effect_log.count(f"replacer:{result.id}") == 1
