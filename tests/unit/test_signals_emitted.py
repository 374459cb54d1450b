"""Signals and progress are sent where the library acts: a task's take, fencing, dead work.

In-process executions (``apply``) on a real SQLite store; the takeover that fences a running
execution is a real claim taken by another owner through the store.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult
from celery.utils.dispatch import Signal

from celery_resilient import CheckpointError, Resilient, ResumableTask, WorkDead, signals
from celery_resilient.core import codec
from celery_resilient.store.sql import Store
from tests.integration.helpers import expire, never_live, owner, run, take


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = Celery(f"emit-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url=f"sqlite:///{tmp_path}/store.sqlite3",
                    resilient_max_attempts=1)
    Resilient(app)
    yield app
    Resilient.of(app).store.dispose()


class Recorder:
    def __init__(self, signal: Signal) -> None:
        self.signal = signal
        self.calls: list[dict[str, Any]] = []

    def __call__(self, sender: Any = None, **kwargs: Any) -> None:
        self.calls.append({"sender": sender, **kwargs})

    def __enter__(self) -> Recorder:
        self.signal.connect(self, weak=False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.signal.disconnect(self)


def store_of(app: Celery) -> Store:
    return Resilient.of(app).store


def test_duplicate_skipped_when_the_work_is_already_done(app: Celery) -> None:
    runs: list[int] = []

    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.once")
    def once(self: ResumableTask, x: int) -> int:
        runs.append(x)
        return x * 2

    assert once.apply((21,), task_id="k-dup").get() == 42
    with Recorder(signals.duplicate_skipped) as rec:
        assert once.apply((21,), task_id="k-dup").get() == 42
    assert runs == [21]
    assert [(c["sender"], c["work_key"], c["task_id"], c["task"], c["reason"])
            for c in rec.calls] == [("emit.once", "k-dup", "k-dup", "emit.once", "done")]
    assert rec.calls[0]["app"] is app


def test_work_dead_when_a_delivery_finds_it_past_the_death_cap(app: Celery) -> None:
    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.poison")
    def poison(self: ResumableTask) -> str:
        return "ran"

    store = store_of(app)
    run(store, "k-dead", owner("gone@host"), task_id="k-dead")
    expire(store, "k-dead")
    with Recorder(signals.work_dead) as rec:
        result = poison.apply(task_id="k-dead")
    assert isinstance(result.result, WorkDead)
    assert [(c["sender"], c["work_key"]) for c in rec.calls] == [("emit.poison", "k-dead")]
    assert "died 1 times" in rec.calls[0]["reason"]
    row = store.get_work("k-dead")
    assert row is not None and row.state == "dead"


def test_work_fenced_when_a_newer_execution_took_the_claim(app: Celery) -> None:
    app.conf.resilient_max_attempts = 5
    store = store_of(app)

    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.zombie")
    def zombie(self: ResumableTask) -> str:
        self.checkpoint.save({"row": 1})
        expire(store, self.work_key)  # our lease lapses; another worker takes over
        outcome = take(store, self.work_key, owner("rescuer@host"), task_id="k-fence",
                       is_live=never_live)
        assert outcome.action == "run"
        self.checkpoint.save({"row": 2})  # refused: StaleClaimError
        return "not reached"

    with Recorder(signals.work_fenced) as rec:
        zombie.apply(task_id="k-fence")
    assert [(c["sender"], c["work_key"], c["epoch"]) for c in rec.calls] == [
        ("emit.zombie", "k-fence", 1)]
    assert "superseded" in rec.calls[0]["error"]
    found = store.load_checkpoint("k-fence")
    assert found is not None and codec.decode(found[0]) == {"row": 1}  # the zombie's 2nd save


def test_progress_is_published_as_the_task_state(tmp_path: Path) -> None:
    app = Celery("progress", broker="memory://", backend="cache+memory://",
                 set_as_current=False)
    app.conf.resilient_store_url = f"sqlite:///{tmp_path}/p.sqlite3"
    Resilient(app)
    seen: list[tuple[str, Any]] = []

    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.progress")
    def counted(self: ResumableTask, total: int) -> int:
        for i in range(total):
            self.checkpoint.save({"i": i + 1}, progress=(i + 1, total))
            res = AsyncResult(self.request.id, app=app)
            seen.append((res.state, res.info))
        return total

    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.quiet",
              ignore_result=True)
    def quiet(self: ResumableTask) -> str:
        self.checkpoint.save({"i": 1}, progress=(1, 1))
        res = AsyncResult(self.request.id, app=app)
        seen.append((res.state, res.info))
        return "done"

    try:
        assert counted.apply((2,), task_id="k-progress").get() == 2
        assert seen == [("PROGRESS", {"done": 1, "total": 2}),
                        ("PROGRESS", {"done": 2, "total": 2})]
        seen.clear()
        assert quiet.apply(task_id="k-quiet").get() == "done"
        assert seen == [("PENDING", None)]  # ignore_result: nothing published
        assert Resilient.of(app).store.load_checkpoint("k-quiet") is not None
    finally:
        Resilient.of(app).store.dispose()


def test_progress_without_a_result_backend_only_saves(app: Celery) -> None:
    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.nobackend")
    def nobackend(self: ResumableTask) -> int:
        return self.checkpoint.save({"i": 1}, progress=(1, 3))

    assert nobackend.apply(task_id="k-nb").get() == 1
    assert store_of(app).load_checkpoint("k-nb") is not None


@pytest.mark.parametrize("bad", [(1,), (1, 2, 3), ("1", 2), (-1, 2), (1.5, 2), (True, 2), 5])
def test_invalid_progress_saves_nothing(app: Celery, bad: Any) -> None:
    @app.task(base=ResumableTask, bind=True, shared=False, name="emit.badprogress")
    def badprogress(self: ResumableTask) -> str:
        self.checkpoint.save({"i": 1}, progress=bad)
        return "saved"

    result = badprogress.apply(task_id="k-bad")
    assert isinstance(result.result, CheckpointError)
    assert "progress must be (done, total)" in str(result.result)
    assert store_of(app).load_checkpoint("k-bad") is None
