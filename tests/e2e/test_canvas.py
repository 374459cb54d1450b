"""Canvas built from resumable tasks on a real worker (Redis broker and result backend):
``self.replace`` with a chord or a group gives the caller what plain Celery gives, and its
replacement runs once however often the replaced request comes back."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery

from celery_resilient.testing import EffectLog

from .canvasproj import create_app
from .conftest import Project, close_result_client


def _canvas(project: Project, concurrency: int) -> Celery:
    project.nodes.worker("tests.e2e.canvasproj", name="canvas", concurrency=concurrency,
                         queues=(project.queue,), env=project.env())
    app = create_app(project.env())
    app.conf.task_default_queue = project.queue
    return app


@pytest.fixture
def canvas(make_project: Callable[..., Project], redis_url: str) -> Iterator[Celery]:
    app = _canvas(make_project(redis_url), 2)
    yield app
    close_result_client(app)


@pytest.fixture
def canvas_one(make_project: Callable[..., Project], redis_url: str) -> Iterator[Celery]:
    """One pool process: the queue is taken in order."""
    app = _canvas(make_project(redis_url), 1)
    yield app
    close_result_client(app)


@pytest.fixture
def canvas_slow_hold(make_project: Callable[..., Project],
                     redis_url: str) -> Iterator[Celery]:
    """A handed-back claim held 2 s, swept every second (the defaults are 60 s and 5 s)."""
    project = make_project(redis_url)
    project.extra.update(resilient_submit_timeout=2, resilient_sweep_interval=1)
    app = _canvas(project, 2)
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


def test_a_replaced_task_delivered_twice_runs_its_replacement_once(
        canvas_one: Celery, effect_log: EffectLog) -> None:
    """The replaced request's claim is handed to the replacement alone: a second delivery of
    the replaced message (same task id) is a duplicate, not a second replacement."""
    replacer = canvas_one.tasks["canvas.replace_by_chord"]
    first = replacer.apply_async()
    replacer.apply_async(task_id=first.id)
    assert first.get(timeout=60) == 3 + 7
    # Everything sent after it ran behind it (one pool process): nothing is left to run.
    assert canvas_one.tasks["canvas.add"].delay(7, 7).get(timeout=60) == 14
    counts = effect_log.counts()
    assert counts[f"replacer:{first.id}"] == 1, counts
    adds = [k for k in counts if k.startswith("add:")]
    assert len(adds) == 3 and all(counts[k] == 1 for k in adds), counts
    assert len([k for k in counts if k.startswith("tsum:")]) == 1, counts


def test_a_replacement_slower_than_the_hold_is_not_sent_again(
        canvas_slow_hold: Celery, effect_log: EffectLog) -> None:
    """The sweeper leaves a replaced claim to the replacement: a chord whose headers take
    longer than ``resilient_submit_timeout`` (the hold of a handed-back claim) does not get
    the replaced request re-published and run again."""
    replacer = canvas_slow_hold.tasks["canvas.replace_by_slow_chord"]
    result = replacer.apply_async((6,))
    assert result.get(timeout=90) == 4
    counts = effect_log.counts()
    assert counts[f"replacer:{result.id}"] == 1, counts
    assert counts["pause:h1"] == 1 and counts["pause:h2"] == 1, counts
