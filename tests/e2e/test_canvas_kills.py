"""Canvas exactly once at the points between "ended in the store" and "Celery told": a worker
(or only its pool process) SIGKILLed right after a failure is recorded, and right after a
result is committed but before the acknowledgement. Redis broker and result backend (chords
count their parts there), library defaults. The copy that comes back must do what Celery
would have done after the body, once, without running the body again: every chain link
once, every chord body once with every header's result, every errback once, every caller's
result SUCCESS or the expected FAILURE."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from celery import Celery, chain, chord
from celery.backends.redis import RedisBackend

from celery_resilient.tasks import replay
from celery_resilient.testing import EffectLog, wait_for

from .canvasproj import create_app
from .conftest import Project, close_result_client

SCOPES = {"worker": {}, "pool-process": {"RESILIENT_KILL_SCOPE": "process"}}
#: Celery 5.7's Redis backend counts a chord part once however often it is reported; older
#: ones would count it twice, so there the window stays open (docs/guarantees.md, section 6).
COUNTS_ONCE = pytest.mark.skipif(
    not replay.counts_each_part_once(RedisBackend(app=Celery(set_as_current=False))),
    reason="this Celery's Redis backend counts a re-reported chord part twice: the "
           "chord-count window is a documented gap there (guarantees.md, section 6)")


@pytest.fixture
def clients() -> Iterator[list[Celery]]:
    made: list[Celery] = []
    yield made
    for app in made:
        close_result_client(app)


def _client(project: Project, clients: list[Celery]) -> Celery:
    """The same app in the test: its task classes, its result backend."""
    app = create_app(project.env())
    app.conf.task_default_queue = project.queue
    clients.append(app)
    return app


def _start(project: Project, point: str, scope: str, tmp_path: object,
           concurrency: int = 2) -> object:
    env = {"RESILIENT_KILL_AT": point, "RESILIENT_KILL_ONCE": f"{tmp_path}/killed",
           **SCOPES[scope]}
    worker = project.nodes.worker("tests.e2e.canvasproj", name="canvas",
                                  concurrency=concurrency,
                                  queues=(project.queue,), env={**project.env(), **env})
    return worker


def _fired(tmp_path: object) -> bool:
    return os.path.exists(f"{tmp_path}/killed")


def _chord_killed_at(point: str, project: Project, effect_log: EffectLog, tmp_path: object,
                     scope: str, clients: list[Celery], headers: int) -> None:
    """A chord of ``headers`` additions, a kill at ``point``: every header once, the body
    once with every header's result."""
    # One pool process: a whole-worker kill then interrupts no other header's body (that
    # body would run again, as any interrupted body does, and count its effect twice).
    worker = _start(project, point, scope, tmp_path, concurrency=1)
    app = _client(project, clients)
    add, tsum = app.tasks["canvas.add"], app.tasks["canvas.tsum"]
    result = chord([add.si(i, i) for i in range(headers)], tsum.s()).apply_async()
    wait_for(lambda: _fired(tmp_path), 60, "the kill point")
    if scope == "worker":
        worker.restart()  # type: ignore[attr-defined]
    numbers = [2 * i for i in range(headers)]
    assert result.get(timeout=90) == sum(numbers)
    counts = effect_log.counts()
    adds = [k for k in counts if k.startswith("add:")]
    assert len(adds) == headers and all(counts[k] == 1 for k in adds), counts
    tsums = [e for e in effect_log.entries() if e["effect"].startswith("tsum:")]
    assert len(tsums) == 1 and tsums[0]["numbers"] == numbers, tsums


@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_failure_recorded_then_killed_still_reaches_celery(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, scope: str, clients: list[Celery]) -> None:
    project = make_project(redis_url)
    worker = _start(project, "after_failed", scope, tmp_path)
    app = _client(project, clients)
    alone = app.tasks["canvas.boom"].apply_async(("alone",),
                                                 link_error=app.tasks["canvas.errback"].si("A"))
    wait_for(lambda: _fired(tmp_path), 60, "the kill point")
    if scope == "worker":
        worker.restart()  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="boom alone"):
        alone.get(timeout=60)
    wait_for(lambda: effect_log.count("errback:A") >= 1, 30, "the errback")
    in_chord = chord([app.tasks["canvas.add"].si(1, 1), app.tasks["canvas.boom"].si("chord")],
                     app.tasks["canvas.tsum"].s().on_error(app.tasks["canvas.errback"].si("B"))
                     ).apply_async()
    with pytest.raises(Exception):  # noqa: B017 (Celery's ChordError, or the header's error)
        in_chord.get(timeout=60)
    wait_for(lambda: effect_log.count("errback:B") >= 1, 30, "the chord's errback")
    counts = effect_log.counts()
    assert counts["boom:alone"] == 1, "the failed body ran again"
    assert counts["errback:A"] == 1 and counts["errback:B"] == 1, counts
    assert not any(k.startswith("tsum:") for k in counts), "the chord body ran"


@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_result_committed_then_killed_before_the_ack_moves_the_canvas_on(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, scope: str, clients: list[Celery]) -> None:
    project = make_project(redis_url)
    worker = _start(project, "before_ack", scope, tmp_path)
    app = _client(project, clients)
    add = app.tasks["canvas.add"]
    links = chain(add.s(1, 1), add.s(1), add.s(1)).apply_async()
    wait_for(lambda: _fired(tmp_path), 60, "the kill point")
    if scope == "worker":
        worker.restart()  # type: ignore[attr-defined]
    assert links.get(timeout=60) == 4
    headers = chord([add.si(i, i) for i in range(5)], app.tasks["canvas.tsum"].s()).apply_async()
    assert headers.get(timeout=60) == sum(2 * i for i in range(5))
    counts = effect_log.counts()
    adds = [k for k in counts if k.startswith("add:")]
    assert len(adds) == 8 and all(counts[k] == 1 for k in adds), counts
    tsums = [e for e in effect_log.entries() if e["effect"].startswith("tsum:")]
    assert len(tsums) == 1 and tsums[0]["numbers"] == [0, 2, 4, 6, 8]


@COUNTS_ONCE
@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_chord_part_stored_then_killed_before_its_count_still_fires_the_chord(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, scope: str, clients: list[Celery]) -> None:
    """Celery's own window: a header's SUCCESS stored, its part not counted. Plain Celery's
    copy sees SUCCESS and the chord waits for ever; the copy here counts the part (Celery
    5.7's Redis backend counts a part once however often it is reported)."""
    _chord_killed_at("before_chord_count", make_project(redis_url), effect_log, tmp_path,
                     scope, clients, headers=4)


@COUNTS_ONCE
@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_failed_chord_part_stored_then_killed_before_its_count_fails_the_chord(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, scope: str, clients: list[Celery]) -> None:
    """The same window for a header that failed: FAILURE stored, not counted. The copy
    counts it: the chord fails, its errback runs once, no header's body runs again."""
    project = make_project(redis_url)
    worker = _start(project, "before_chord_count", scope, tmp_path, concurrency=1)
    app = _client(project, clients)
    boom = app.tasks["canvas.boom"]
    failing = chord([boom.si("h1"), boom.si("h2")],
                    app.tasks["canvas.tsum"].s().on_error(app.tasks["canvas.errback"].si("C"))
                    ).apply_async()
    wait_for(lambda: _fired(tmp_path), 60, "the kill point")
    if scope == "worker":
        worker.restart()  # type: ignore[attr-defined]
    with pytest.raises(Exception):  # noqa: B017 (Celery's ChordError)
        failing.get(timeout=60)
    wait_for(lambda: effect_log.count("errback:C") >= 1, 30, "the chord's errback")
    counts = effect_log.counts()
    assert counts["boom:h1"] == 1 and counts["boom:h2"] == 1, counts
    assert counts["errback:C"] == 1, counts
    assert not any(k.startswith("tsum:") for k in counts), "the chord body ran"


DATABASE_BACKEND = "db+" + os.environ.get(
    "RESILIENT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.mark.parametrize("point", ["after_failed", "before_ack"])
def test_on_the_database_backend_a_chord_survives_a_kill_between_store_and_celery(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, point: str, clients: list[Celery]) -> None:
    """Celery's database result backend has no native join: a chord's body is fired by
    ``celery.chord_unlock`` polling the headers' states, so a stored state is all a header
    owes its chord. A worker killed after a header's failure is recorded, or after its
    result commits and before the ack: the chord still ends as on plain Celery, once."""
    project = make_project(redis_url)
    project.extra["result_backend"] = DATABASE_BACKEND
    worker = _start(project, point, "worker", tmp_path, concurrency=1)
    app = _client(project, clients)
    add, boom, tsum = (app.tasks[n] for n in ("canvas.add", "canvas.boom", "canvas.tsum"))
    errback = app.tasks["canvas.errback"]
    if point == "after_failed":
        result = chord([add.si(1, 1), boom.si("db")],
                       tsum.s().on_error(errback.si("D"))).apply_async()
    else:
        result = chord([add.si(i, i) for i in range(3)], tsum.s()).apply_async()
    wait_for(lambda: _fired(tmp_path), 60, "the kill point")
    worker.restart()  # type: ignore[attr-defined]
    if point == "after_failed":
        with pytest.raises(Exception):  # noqa: B017 (Celery's ChordError)
            result.get(timeout=90)
        wait_for(lambda: effect_log.count("errback:D") >= 1, 60, "the chord's errback")
    else:
        assert result.get(timeout=90) == 0 + 2 + 4
    counts = effect_log.counts()
    adds = [k for k in counts if k.startswith("add:")]
    assert len(adds) == (1 if point == "after_failed" else 3), counts
    assert all(counts[k] == 1 for k in adds), counts
    tsums = [e for e in effect_log.entries() if e["effect"].startswith("tsum:")]
    if point == "after_failed":
        assert counts["boom:db"] == 1 and counts["errback:D"] == 1, counts
        assert tsums == [], "the chord body ran"
    else:
        assert len(tsums) == 1 and tsums[0]["numbers"] == [0, 2, 4], tsums


@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_link_sent_then_killed_before_success_is_stored_runs_once(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, scope: str, clients: list[Celery]) -> None:
    """Celery sends a success's ``link`` callbacks, then stores SUCCESS. Killed in between,
    the copy returns the stored result and Celery sends the callbacks again: under the ids
    they had the first time, so the resumable callback runs once (it was a new task id each
    time, and ran twice)."""
    project = make_project(redis_url)
    worker = _start(project, "before_success_stored", scope, tmp_path, concurrency=1)
    app = _client(project, clients)
    parent = app.tasks["canvas.add"].apply_async((2, 3),
                                                 link=app.tasks["canvas.linked"].s("L"))
    wait_for(lambda: _fired(tmp_path), 60, "the kill point")
    if scope == "worker":
        worker.restart()  # type: ignore[attr-defined]
    assert parent.get(timeout=60) == 5
    wait_for(lambda: effect_log.count("linked:L") >= 1, 60, "the link")
    # One pool process takes the queue in order: once a task sent now has run, every copy of
    # the link that was sent has been taken.
    assert app.tasks["canvas.add"].delay(7, 7).get(timeout=60) == 14
    counts = effect_log.counts()
    assert counts["linked:L"] == 1, [e for e in effect_log.entries()
                                     if e["effect"] == "linked:L"]
    assert len([k for k in counts if k.startswith("add:")]) == 2, counts


@COUNTS_ONCE
@pytest.mark.parametrize("scope", list(SCOPES))
def test_a_chord_body_claimed_then_killed_before_it_is_sent_still_runs_once(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        tmp_path: object, scope: str, clients: list[Celery]) -> None:
    """Celery 5.7 claims the right to send a chord's body (for 10 s by default), then sends
    it. Killed in between, nobody sent the body: the copy of the last header waits for the
    claim to expire and counts its part again, which sends it. Plain Celery's copy finds
    SUCCESS stored and the chord waits for ever."""
    _chord_killed_at("before_chord_body_sent", make_project(redis_url), effect_log, tmp_path,
                     scope, clients, headers=3)
