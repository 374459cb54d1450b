"""What a copy of ended work asks of the result backend (tasks/replay.py): the chord part
counted again only where a second count counts once; a failure's chain and errbacks again."""

from __future__ import annotations

from typing import Any

import pytest
from celery.app.task import Context

from celery_resilient.tasks import replay


class Recording:
    """A result backend's end-of-request calls, recorded."""

    supports_native_join = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_chord_part_return(self, request: Any, state: str, result: Any) -> None:
        self.calls.append(("count", (request.id, state, result)))

    def mark_as_done(self, task_id: str, result: Any, request: Any = None) -> None:
        self.calls.append(("done", (task_id, request.chord)))

    def mark_as_failure(self, task_id: str, exc: Any, traceback: Any = None,
                        request: Any = None) -> None:
        self.calls.append(("failure", (task_id, request.chord, traceback)))

    def get_task_meta(self, task_id: str) -> dict[str, Any]:
        return {"status": "FAILURE", "traceback": "tb"}


class CountsOnce(Recording):
    def _chord_part_return_script(self) -> None:  # Celery 5.7's Redis backend has one
        return None


def _request(chord: Any = None) -> Context:
    return Context({"id": "t1", "group": "g1" if chord else None, "chord": chord})


def test_a_stored_success_in_a_chord_counts_its_part_again_where_that_counts_once() -> None:
    backend = CountsOnce()
    replay.report_again(backend, _request({"task": "body"}), "SUCCESS", 3)
    assert backend.calls == [("count", ("t1", "SUCCESS", 3))]


def test_a_stored_success_is_not_stored_again_nor_counted_where_a_replay_counts_twice(
        caplog: pytest.LogCaptureFixture) -> None:
    backend = Recording()
    replay.report_again(backend, _request({"task": "body"}), "SUCCESS", 3)
    assert backend.calls == []
    assert "not counted again" in caplog.text


def test_a_stored_success_outside_a_chord_has_nothing_left() -> None:
    backend = CountsOnce()
    replay.report_again(backend, _request(), "SUCCESS", 3)
    assert backend.calls == []


def test_a_stored_failure_fails_again_with_its_traceback_without_a_double_count() -> None:
    backend = Recording()
    request = _request({"task": "body"})
    replay.report_again(backend, request, "FAILURE", ValueError("x"))
    assert backend.calls == [("failure", ("t1", None, "tb"))]
    assert request.chord == {"task": "body"}, "the task's own request is left as it was"
    once = CountsOnce()
    replay.report_again(once, request, "FAILURE", ValueError("x"))
    assert once.calls == [("failure", ("t1", {"task": "body"}, "tb"))]


def test_a_backend_failing_now_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class Down(CountsOnce):
        def on_chord_part_return(self, request: Any, state: str, result: Any) -> None:
            raise ConnectionError("backend down")

    replay.report_again(Down(), _request({"task": "body"}), "SUCCESS", 3)
    assert "not reported again (ConnectionError: backend down)" in caplog.text
