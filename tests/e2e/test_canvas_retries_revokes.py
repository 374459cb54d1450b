"""Retries inside a canvas and a revoked group, each with a whole-worker SIGKILL at the
moment that matters. Redis broker and result backend with their defaults, library defaults.

- A chain link and a chord header that retry: the worker is killed while the retry waits
  for its countdown. The retry runs once, the canvas finishes once with its result, no
  earlier link runs again.
- A group revoked while its first member runs: the worker is killed after the revoke.
  Plain Celery forgets the revoke with the worker and runs the members after the restart;
  here no member starts after the revoke, the one that was running ends ``revoked``, and
  every member's result is REVOKED.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from celery import Celery, chain, chord, group
from celery.exceptions import TaskRevokedError

from celery_resilient.testing import EffectLog, wait_for

from .canvasproj import create_app
from .conftest import Project, close_result_client


@pytest.fixture
def client(make_project: Callable[..., Project],
           redis_url: str) -> Iterator[tuple[Project, Celery]]:
    project = make_project(redis_url)
    app = create_app(project.env())
    app.conf.task_default_queue = project.queue
    yield project, app
    close_result_client(app)


def _worker(project: Project, concurrency: int) -> object:
    return project.nodes.worker("tests.e2e.canvasproj", name="canvas", concurrency=concurrency,
                                queues=(project.queue,), env=project.env())


def test_a_retry_inside_a_chain_and_a_chord_survives_a_kill_while_it_waits(
        client: tuple[Project, Celery], effect_log: EffectLog) -> None:
    project, app = client
    worker = _worker(project, 2)
    add, retry_once, tsum = (app.tasks[n] for n in ("canvas.add", "canvas.retry_once",
                                                    "canvas.tsum"))
    links = chain(add.s(1, 1), retry_once.s("link"), add.s(100)).apply_async()
    parts = chord([add.si(2, 2), retry_once.si(5, "header")], tsum.s()).apply_async()
    # Both retries are published (Celery stores RETRY after sending the retry) and wait.
    wait_for(lambda: effect_log.count("try:link") == 1 and effect_log.count("try:header") == 1
             and links.parent.state == "RETRY"  # type: ignore[union-attr]
             and parts.parent.results[1].state == "RETRY",  # type: ignore[union-attr]
             60, "both retries waiting for their countdown")
    worker.kill("SIGKILL")  # type: ignore[attr-defined]
    worker.restart()  # type: ignore[attr-defined]
    assert links.get(timeout=60) == 1 + 1 + 10 + 100
    assert parts.get(timeout=60) == 4 + 15
    counts = effect_log.counts()
    assert counts["try:link"] == 1 and counts["try:header"] == 1, counts
    assert counts["retried:link"] == 1 and counts["retried:header"] == 1, counts
    adds = [k for k in counts if k.startswith("add:")]
    assert len(adds) == 3 and all(counts[k] == 1 for k in adds), counts
    tsums = [e for e in effect_log.entries() if e["effect"].startswith("tsum:")]
    assert len(tsums) == 1 and tsums[0]["numbers"] == [4, 15], tsums


def test_a_revoked_group_stays_revoked_after_its_worker_is_killed(
        client: tuple[Project, Celery], effect_log: EffectLog) -> None:
    project, app = client
    worker = _worker(project, 1)  # one member runs, the others wait prefetched
    slow = app.tasks["canvas.slow"]
    members = group(slow.si(f"m{i}") for i in range(4)).apply_async()
    ids = [r.id for r in members.results]
    wait_for(lambda: effect_log.count("start:m0") == 1, 60, "the first member running")
    members.revoke()
    wait_for(lambda: all(project.store.is_revoked(i) for i in ids), 30,
             "the revokes copied into the store")
    worker.kill("SIGKILL")  # type: ignore[attr-defined]
    worker.restart()  # type: ignore[attr-defined]
    wait_for(lambda: all(r.state == "REVOKED" for r in members.results), 60,
             "every member REVOKED")
    with pytest.raises(TaskRevokedError):
        members.get(timeout=10)
    # One pool process takes the queue in order: once a task sent now has run, every copy
    # that came back before it was taken and dropped.
    assert app.tasks["canvas.add"].delay(7, 7).get(timeout=60) == 14
    counts = effect_log.counts()
    assert counts.get("start:m0") == 1 and "end:m0" not in counts, counts
    assert not any(counts.get(f"start:m{i}") for i in range(1, 4)), counts
    assert project.state(ids[0]) == "revoked"
