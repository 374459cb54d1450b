"""Bad input gets a clear error and loses nothing; an unreachable store is StoreUnavailable."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.core import codec
from celery_resilient.errors import (
    CheckpointError,
    LedgerKeyError,
    ResilientError,
    SerializationError,
    StoreUnavailable,
)
from celery_resilient.store.sql import Store
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.execution import Execution
from celery_resilient.tasks.ledger import Ledger
from celery_resilient.tasks.steps import run_step

from .helpers import always_live, execution, owner, run


class Unstorable:
    pass


@pytest.fixture
def x(store: Store) -> Execution:
    return execution(store, run(store, "k", owner()), max_checkpoint_bytes=200)


def _saved(store: Store) -> tuple[Any, int]:
    found = store.load_checkpoint("k")
    assert found is not None
    return codec.decode(found[0]), found[1]


@pytest.mark.parametrize(("state", "problem"), [
    ({"row": 3, "handle": Unstorable()}, "Unstorable"),
    ({"seen": {1, 2}}, "set"),
])
def test_unserialisable_checkpoint_is_refused_and_the_previous_one_kept(
        store: Store, x: Execution, state: Any, problem: str) -> None:
    cp = Checkpoint(x)
    assert cp.save({"row": 2}) == 1
    with pytest.raises(CheckpointError) as info:
        cp.save(state)
    message = str(info.value)
    assert "not JSON-serialisable" in message and problem in message
    assert "'k'" in message  # names the work
    assert _saved(store) == ({"row": 2}, 1)
    assert cp.sequence == 1
    assert cp.save({"row": 3}) == 2  # and the handle still works


def test_oversized_checkpoint_is_refused_and_the_previous_one_kept(store: Store,
                                                                   x: Execution) -> None:
    cp = Checkpoint(x)
    cp.save({"row": 1})
    big = {"blob": "x" * 500}
    with pytest.raises(CheckpointError) as info:
        cp.save(big)
    message = str(info.value)
    assert "resilient_max_checkpoint_bytes=200" in message
    assert f"{len(codec.encode(big))} bytes" in message
    assert _saved(store) == ({"row": 1}, 1)


def test_checkpoint_at_exactly_the_limit_is_stored(store: Store, x: Execution) -> None:
    overhead = len(codec.encode({"s": ""}))
    state = {"s": "x" * (200 - overhead)}
    assert len(codec.encode(state).encode()) == 200
    assert Checkpoint(x).save(state) == 1
    assert _saved(store) == (state, 1)


BAD_KEYS: list[Any] = ["", "   ", "k" * 256, None, 42]


@pytest.mark.parametrize("key", BAD_KEYS, ids=["empty", "blank", "too-long", "none", "int"])
def test_bad_ledger_key_is_refused(store: Store, x: Execution, key: Any) -> None:
    calls: list[int] = []
    ledger = Ledger(store, x)
    with pytest.raises(LedgerKeyError) as info:
        ledger.once(key, calls.append, 1)
    assert "ledger key" in str(info.value)
    if key is not None:  # atomic(None) means "this work's own key"
        with pytest.raises(LedgerKeyError), ledger.atomic(key):
            calls.append(2)
    with pytest.raises(LedgerKeyError):
        ledger.applied(key)
    assert calls == []


def test_ledger_key_of_max_length_is_accepted(store: Store, x: Execution) -> None:
    assert Ledger(store, x).once("k" * 255, lambda: "ok") == "ok"


def test_atomic_outside_a_task_needs_a_key(store: Store) -> None:
    with pytest.raises(LedgerKeyError, match="explicit key"), Ledger(store).atomic():
        pass


def test_unserialisable_ledger_result_names_the_key(store: Store, x: Execution) -> None:
    with pytest.raises(SerializationError, match="ledger key 'pay:1'"):
        Ledger(store, x).once("pay:1", Unstorable)
    assert store.ledger_get("pay:1") is None


@pytest.mark.parametrize("name", ["", None, 7, "s" * 256], ids=["empty", "none", "int", "long"])
def test_invalid_step_name_is_refused_before_running(store: Store, x: Execution,
                                                     name: Any) -> None:
    calls: list[int] = []
    with pytest.raises(ResilientError, match="step name"):
        run_step(x, name, calls.append, 1)
    assert calls == []


def test_unserialisable_step_result_names_the_step(store: Store, x: Execution) -> None:
    with pytest.raises(SerializationError, match="step 'make'"):
        run_step(x, "make", Unstorable)
    assert store.get_step("k", "make") is None


# -- an unreachable store -------------------------------------------------------------------


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def down(closed_port: int) -> Iterator[Store]:
    s = Store(f"postgresql+psycopg://postgres@127.0.0.1:{closed_port}/test", "down_")
    yield s
    s.dispose()


def _down_execution(down: Store, store: Store) -> Execution:
    return Execution(down, execution(store, run(store, "k", owner())).config, "k", 1, 1)


OPERATIONS: dict[str, Callable[[Store, Execution], Any]] = {
    "ensure_schema": lambda s, x: s.ensure_schema(False),
    "take": lambda s, x: s.take("k", "t", "tid", None, owner(), 30, 5, always_live),
    "record_receipt": lambda s, x: s.record_receipt("k", "t", "tid", None, None, owner(), 30),
    "heartbeat": lambda s, x: s.heartbeat(owner(), 30),
    "claim_orphans": lambda s, x: s.claim_orphans(owner(), 10, 30),
    "finish": lambda s, x: s.finish("k", 1, None),
    "checkpoint.load": lambda s, x: Checkpoint(x).load(default={}),
    "checkpoint.save": lambda s, x: Checkpoint(x).save({"row": 1}),
    "step": lambda s, x: run_step(x, "s", lambda: 1),
    "ledger.once": lambda s, x: Ledger(s, x).once("l", lambda: 1),
    "ledger.atomic": lambda s, x: Ledger(s, x).atomic("l").__enter__(),
}


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("op", list(OPERATIONS))
def test_unreachable_postgresql_is_store_unavailable(down: Store, store: Store,
                                                     op: str) -> None:
    with pytest.raises(StoreUnavailable) as info:
        OPERATIONS[op](down, _down_execution(down, store))
    assert "unreachable" in str(info.value) or "lost" in str(info.value)


@pytest.mark.parametrize("write", ["checkpoint.save", "checkpoint.clear", "step",
                                   "ledger.once", "ledger.atomic"])
def test_fenced_writes_inside_atomic_are_refused_not_deadlocked(store: Store, write: str) -> None:
    """A checkpoint saved inside ledger.atomic() must not wait for ever
    on PostgreSQL (its own connection needs the claim row the block's transaction holds)."""
    x = execution(store, run(store, "k", owner()))
    ledger = Ledger(store, x)
    writes: dict[str, Callable[[], Any]] = {
        "checkpoint.save": lambda: Checkpoint(x).save({"row": 1}),
        "checkpoint.clear": lambda: Checkpoint(x).clear(),
        "step": lambda: run_step(x, "s", lambda: 1),
        "ledger.once": lambda: ledger.once("other", lambda: 1),
        "ledger.atomic": lambda: ledger.atomic("inner").__enter__(),
    }
    refused = r"inside ledger\.atomic\('k:atomic'\) is not supported.*save checkpoints.*after it"
    with pytest.raises(ResilientError, match=refused), ledger.atomic():
        writes[write]()
    assert store.ledger_get("k:atomic") is None, "the block was rolled back with the error"
    Checkpoint(x).save({"row": 1})  # after the block, the same write works
    assert store.load_checkpoint("k") is not None


@pytest.mark.parametrize("too_long", ["name", "id"])
def test_a_task_name_or_id_longer_than_the_store_keeps_is_refused_by_name(
        store: Store, too_long: str) -> None:
    """On every dialect a name or id over 255 characters is refused before the take, with
    what and how long, and no row is written (the database's own refusal named neither)."""
    app = Celery("long-names", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix,
                    task_store_eager_result=False)
    Resilient(app)
    name = "n" * 256 if too_long == "name" else "proj.short"
    ran: list[int] = []

    @app.task(base=ResumableTask, bind=True, shared=False, name=name)
    def short(self: ResumableTask) -> int:
        ran.append(1)
        return 1

    task_id = "i" * 256 if too_long == "id" else "short-id"
    result = short.apply(task_id=task_id, headers={"work_key": "long-names-key"})
    assert result.failed() and ran == []
    assert isinstance(result.result, ResilientError)
    assert f"the task {too_long} " in str(result.result) and "256 chars" in str(result.result)
    assert store.get_work("long-names-key") is None and store.get_work(task_id) is None
