"""Work-key derivation: header, then the task's hook, then the task id."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from celery import Celery

from celery_resilient import ResumableTask
from celery_resilient.core import workkey
from celery_resilient.errors import ResilientError


class Hooked:
    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def derive_work_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls.append((args, kwargs))
        return self.result


class Plain:
    pass


def derive(task: Any, headers: Mapping[str, Any] | None = None,
           args: Sequence[Any] | None = (1,), kwargs: Mapping[str, Any] | None = None) -> str:
    return workkey.derive(task, "task-id-1", args, kwargs or {"k": "v"}, headers)


def test_task_id_by_default() -> None:
    assert derive(Plain()) == "task-id-1"
    assert derive(Plain(), headers={}) == "task-id-1"
    assert derive(Plain(), headers={"other": "x"}) == "task-id-1"


def test_hook_gets_args_and_kwargs_and_wins_over_task_id() -> None:
    task = Hooked("invoice:42")
    assert derive(task, args=[42, "a"], kwargs={"k": 1}) == "invoice:42"
    assert task.calls == [((42, "a"), {"k": 1})]


def test_hook_returning_none_falls_back_to_task_id() -> None:
    assert derive(Hooked(None)) == "task-id-1"


def test_header_wins_over_hook_and_task_id() -> None:
    task = Hooked("from-hook")
    assert derive(task, headers={"work_key": "from-header"}) == "from-header"
    assert task.calls == []  # the sender's explicit choice: the hook is not consulted


def test_none_args_and_kwargs_are_accepted() -> None:
    task = Hooked("k")
    assert workkey.derive(task, "tid", None, None, None) == "k"
    assert task.calls == [((), {})]


@pytest.mark.parametrize("bad", ["", 42, ["a"], "x" * 256])
def test_bad_hook_result_rejected_naming_the_hook(bad: Any) -> None:
    with pytest.raises(ResilientError, match=r"Hooked\.derive_work_key"):
        derive(Hooked(bad))


@pytest.mark.parametrize("bad", ["", "x" * 256, 42])
def test_bad_header_rejected(bad: Any) -> None:
    """An explicit work_key header that is empty or too long is an error, not ignored."""
    with pytest.raises(ResilientError, match="'work_key' header"):
        derive(Hooked("from-hook"), headers={"work_key": bad})


def test_too_long_task_id_rejected() -> None:
    with pytest.raises(ResilientError, match="task id"):
        workkey.derive(Plain(), "t" * 256, (), {}, None)


def test_max_length_is_accepted() -> None:
    key = "k" * workkey.MAX_LENGTH
    assert derive(Hooked(key)) == key
    assert derive(Plain(), headers={"work_key": key}) == key


def test_resumable_task_default_hook_uses_the_task_id() -> None:
    app = Celery("wk", broker="memory://", set_as_current=False)

    @app.task(base=ResumableTask, bind=True, name="wk.plain")
    def plain(self: ResumableTask) -> None: ...

    class Invoice(ResumableTask):  # type: ignore[misc]
        def derive_work_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            return f"invoice:{args[0]}"

    @app.task(base=Invoice, bind=True, name="wk.invoice")
    def invoice(self: ResumableTask, number: int) -> None: ...

    assert workkey.derive(app.tasks["wk.plain"], "tid-9", (), {}, {}) == "tid-9"
    assert workkey.derive(app.tasks["wk.invoice"], "tid-9", (42,), {}, {}) == "invoice:42"
