"""Eager mode, ``.apply()`` and direct calls end work as a worker does (SQLite and PostgreSQL).

Plain Celery's result for the caller is the baseline: each case states what plain Celery
gives and checks ours gives the same, plus the store state and how often the body ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_resilient import Resilient, ResumableTask
from celery_resilient.store.sql import Store


class App:
    def __init__(self, store: Store, eager: bool) -> None:
        self.app = Celery("eager-proj", broker="memory://", set_as_current=False)
        self.app.conf.update(resilient_store_url=store.url,
                             resilient_table_prefix=store.prefix,
                             task_always_eager=eager, task_store_eager_result=False)
        Resilient(self.app)
        self.store = store
        self.runs: dict[str, int] = {}
        self.seen: list[Any] = []
        self._define()

    def ran(self, name: str) -> None:
        self.runs[name] = self.runs.get(name, 0) + 1

    def _define(self) -> None:
        app, t = self.app, self

        @app.task(base=ResumableTask, bind=True, shared=False, max_retries=1,
                  name="eager.exhausted")
        def exhausted(self: ResumableTask) -> None:
            t.ran("exhausted")
            raise self.retry(countdown=0, exc=RuntimeError("nope"))

        @app.task(base=ResumableTask, bind=True, shared=False, max_retries=5, name="eager.flaky")
        def flaky(self: ResumableTask) -> int:
            state = self.checkpoint.load(default={"tries": 0})
            t.seen.append(state["tries"])
            state["tries"] += 1
            self.checkpoint.save(state)
            if state["tries"] < 3:
                raise self.retry(countdown=0, exc=RuntimeError("again"))
            return int(state["tries"])

        @app.task(base=ResumableTask, bind=True, shared=False, autoretry_for=(KeyError,),
                  max_retries=2, retry_backoff=True, retry_backoff_max=0, retry_jitter=False,
                  name="eager.auto")
        def auto(self: ResumableTask) -> None:
            t.ran("auto")
            raise KeyError("k")

        @app.task(base=ResumableTask, bind=True, shared=False, name="eager.ignored")
        def ignored(self: ResumableTask) -> None:
            t.ran("ignored")
            raise Ignore()

        @app.task(base=ResumableTask, bind=True, shared=False, name="eager.rejected")
        def rejected(self: ResumableTask) -> None:
            t.ran("rejected")
            raise Reject("bad input", requeue=False)

        @app.task(base=ResumableTask, bind=True, shared=False, name="eager.boom")
        def boom(self: ResumableTask) -> None:
            t.ran("boom")
            raise ValueError("boom")

        @app.task(base=ResumableTask, bind=True, shared=False, name="eager.total")
        def total(self: ResumableTask, n: int) -> dict[str, Any]:
            t.ran("total")
            state = self.checkpoint.load(default={"i": 0, "sum": 0})
            for i in range(state["i"], n):
                state = {"i": i + 1, "sum": state["sum"] + i}
                self.checkpoint.save(state)
            tenfold = self.step("tenfold", lambda: n * 10)
            again = self.step("tenfold", lambda: -1)  # memoized within the call
            charged = self.ledger.once(f"charge:{n}", lambda: f"charged-{n}")
            return {"sum": state["sum"], "step": [tenfold, again], "charged": charged,
                    "key": self.work_key, "token": self.fencing_token}

        self.tasks = {name: app.tasks[f"eager.{name}"] for name in
                      ("exhausted", "flaky", "auto", "ignored", "rejected", "boom", "total")}


@pytest.fixture(params=["always_eager", "apply"])
def proj(request: pytest.FixtureRequest, store: Store) -> Iterator[App]:
    app = App(store, eager=request.param == "always_eager")
    app.mode = request.param  # type: ignore[attr-defined]
    yield app
    app.app.close()


def _send(proj: App, name: str, *args: Any) -> Any:
    task = proj.tasks[name]
    if proj.mode == "apply":  # type: ignore[attr-defined]
        return task.apply(args)
    return task.apply_async(args)


def _state(proj: App, result: Any) -> str | None:
    row = proj.store.get_work(result.id)
    return None if row is None else row.state


def test_retries_exhausted_fail_with_the_exception(proj: App) -> None:
    # plain Celery: FAILURE RuntimeError('nope'), the body ran 1 + max_retries times
    result = _send(proj, "exhausted")
    assert result.state == "FAILURE"
    assert isinstance(result.result, RuntimeError) and str(result.result) == "nope"
    assert proj.runs["exhausted"] == 2
    assert _state(proj, result) == "failed"


def test_retries_resume_from_the_checkpoint(proj: App) -> None:
    # plain Celery: SUCCESS 3; each retry sees the checkpoint of the attempt before it
    result = _send(proj, "flaky")
    assert result.state == "SUCCESS" and result.result == 3
    assert proj.seen == [0, 1, 2]
    assert _state(proj, result) == "done"


def test_autoretry_with_backoff_fails_after_max_retries(proj: App) -> None:
    result = _send(proj, "auto")
    assert result.state == "FAILURE" and isinstance(result.result, KeyError)
    assert proj.runs["auto"] == 3
    assert _state(proj, result) == "failed"


def test_ignore_is_ignored(proj: App) -> None:
    result = _send(proj, "ignored")
    assert result.state == "IGNORED"
    assert proj.runs["ignored"] == 1
    assert _state(proj, result) == "ignored"


def test_reject_without_requeue_fails(proj: App) -> None:
    result = _send(proj, "rejected")
    assert result.state == "REJECTED"  # plain Celery's eager trace gives the same
    assert proj.runs["rejected"] == 1
    row = proj.store.get_work(result.id)
    assert row is not None and row.state == "failed" and "Reject" in (row.error or "")


def test_exception_fails_and_a_copy_of_the_request_runs_nothing(proj: App) -> None:
    task = proj.tasks["boom"]
    first = task.apply(task_id="boom-1")
    assert first.state == "FAILURE" and isinstance(first.result, ValueError)
    assert _state(proj, first) == "failed"
    # A duplicate delivery of the same request: the stored failure is told again (its
    # first telling may have died with its worker), the body does not run.
    again = task.apply(task_id="boom-1")
    assert again.state == "FAILURE" and isinstance(again.result, ValueError)
    assert proj.runs["boom"] == 1
    fresh = task.apply(task_id="boom-2")  # a new request for the work runs
    assert fresh.state == "FAILURE" and proj.runs["boom"] == 2


def test_success_is_done_and_replays_return_the_stored_result(proj: App) -> None:
    task = proj.tasks["total"]
    first = task.apply((4,), task_id="total-1")
    assert first.state == "SUCCESS"
    assert first.result["sum"] == 6 and first.result["step"] == [40, 40]
    assert first.result["token"] == 1 and first.result["key"] == "total-1"
    again = task.apply((4,), task_id="total-1")
    assert again.result == first.result and proj.runs["total"] == 1
    assert _state(proj, first) == "done"


def test_direct_call_runs_the_body_like_a_function(store: Store) -> None:
    """``task(...)`` as Celery users call it in unit tests: no claim, memory-only progress."""
    proj = App(store, eager=False)
    try:
        task = proj.tasks["total"]
        first = task(3)
        second = task(3)
        assert first["sum"] == second["sum"] == 3  # each call starts from an empty checkpoint
        assert first["step"] == [30, 30] and first["token"] == 0
        assert first["key"].startswith("direct-") and first["key"] != second["key"]
        assert proj.runs["total"] == 2
        assert first["charged"] == second["charged"] == "charged-3"  # ledger keys are global
        assert store.list_work() == []  # nothing recorded as work
        with pytest.raises(ValueError, match="boom"):
            proj.tasks["boom"]()
    finally:
        proj.app.close()
