"""The per-task statements on PostgreSQL (``store/hot.py``) run on psycopg's cursor; what
SQLAlchemy would do around them must still happen: errors wrapped in the same classes, a broken
pooled connection invalidated and retried once, and an engine's event listeners (tracing,
error reporting) seeing every statement."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import DataError, DBAPIError

from celery_resilient.core import codec
from celery_resilient.store.hot import _instrumented
from celery_resilient.store.sql import Store

from .helpers import owner, run


def _backend_pids(store: Store) -> set[int]:
    """The backend of the connection hot statements use (the process's kept one)."""
    with store.single() as conn:
        assert not _instrumented(conn), "a listener would send hot statements through SQLAlchemy"
        return {int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())}


def _terminate_backends(store: Store, other: Engine) -> set[int]:
    """Kill the server side of the store's pooled autocommit connections; their pids."""
    pids = _backend_pids(store)
    with other.begin() as conn:
        conn.execute(text("SELECT pg_terminate_backend(p) FROM unnest(CAST(:ps AS int[])) p"),
                     {"ps": sorted(pids)})
    return pids


def _fence_with(store: Store, epoch: Any) -> None:
    with store.single() as conn:
        store._hot.run(conn, "fence", {"k": "k", "e": epoch})


def test_a_driver_error_is_the_class_sqlalchemy_would_raise(pg_store: Store) -> None:
    run(pg_store, "k", owner())
    with pytest.raises(DataError) as on_driver:
        _fence_with(pg_store, "not a number")
    seen: list[str] = []
    event.listen(pg_store.engines[1], "before_cursor_execute",
                 lambda _c, _cur, statement, *_: seen.append(statement))
    with pytest.raises(DataError) as on_sqlalchemy:
        _fence_with(pg_store, "not a number")
    assert seen, "the listener made the statement go through SQLAlchemy"
    assert type(on_driver.value.orig) is type(on_sqlalchemy.value.orig)
    assert on_driver.value.connection_invalidated is False
    assert "invalid input syntax for type bigint" in str(on_driver.value)


def test_a_killed_backend_is_invalidated_and_the_take_and_finish_run_on_a_fresh_one(
        pg_store: Store, other: Engine) -> None:
    claim = run(pg_store, "k", owner())
    before = _terminate_backends(pg_store, other)
    pg_store.save_checkpoint("k", claim.epoch, codec.encode({"row": 1}))  # retried once
    pg_store.finish("k", claim.epoch, codec.encode("ok"))
    assert _backend_pids(pg_store).isdisjoint(before)
    row = pg_store.get_work("k")
    assert row is not None and row.state == "done" and row.result_json == codec.encode("ok")


def test_a_dead_connection_raises_the_wrapped_error_with_invalidation(
        pg_store: Store, other: Engine) -> None:
    claim = run(pg_store, "k", owner())
    before = _terminate_backends(pg_store, other)
    with pytest.raises(DBAPIError) as failed:
        _fence_with(pg_store, claim.epoch)  # unguarded: the raw wrapped error
    assert failed.value.connection_invalidated is True
    _fence_with(pg_store, claim.epoch)  # the pool gave a fresh connection
    assert _backend_pids(pg_store).isdisjoint(before)


def test_listeners_see_every_hot_statement(pg_store: Store) -> None:
    seen: list[str] = []
    for engine in pg_store.engines:
        event.listen(engine, "before_cursor_execute",
                     lambda _c, _cur, statement, *_: seen.append(" ".join(statement.split())))
    who = owner()
    pg_store.record_receipt("k", "proj.task", "tid-k", None, None, who, 30.0)
    claim = run(pg_store, "k", who)  # the take's one-statement path: the receipt is there
    pg_store.save_checkpoint("k", claim.epoch, codec.encode({"row": 1}))
    pg_store.finish("k", claim.epoch, codec.encode("ok"))
    prefix = pg_store.prefix
    assert any(s.startswith(f"UPDATE {prefix}work SET") and
               f"RETURNING {prefix}work.epoch, {prefix}work.attempts, {prefix}work.deaths, "
               f"{prefix}work.checkpoint_json" in s for s in seen), seen  # the take
    assert any(s.startswith(f"UPDATE {prefix}work SET") and "checkpoint_json=" in s and
               s.endswith(f"RETURNING {prefix}work.checkpoint_seq") for s in seen), seen
    assert any(s.startswith(f"UPDATE {prefix}work SET state=") and "result_json" in s
               and "finished_at" in s for s in seen), seen  # the finish
