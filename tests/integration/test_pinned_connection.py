"""The autocommitted connection a process keeps for its single statements on PostgreSQL
(``store/pinned.py``): no pool checkout per statement, yet every case a pooled connection
handles (a concurrent caller, a fork, a dropped store; one left mid-statement:
``test_interrupted_statements.py``) ends as it would with the pool."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import uuid
from typing import Any

from sqlalchemy import Engine, event, text

from celery_resilient.core import codec
from celery_resilient.store.sql import Store
from celery_resilient.testing import wait_for

from .helpers import owner, run


def _backend(store: Store) -> int:
    with store.single() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _alive(other: Engine, pid: int) -> bool:
    with other.connect() as conn:
        found = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                             {"p": pid}).scalar_one()
        conn.rollback()
    return bool(found)


def test_a_thread_s_single_statements_need_no_pool_checkout(pg_store: Store) -> None:
    claim = run(pg_store, "k", owner())
    first = _backend(pg_store)
    checkouts: list[Any] = []
    event.listen(pg_store.engines[1], "checkout", lambda *a: checkouts.append(a))
    for i in range(20):
        pg_store.save_checkpoint("k", claim.epoch, codec.encode({"row": i}))
    pg_store.finish("k", claim.epoch, codec.encode("ok"))
    assert checkouts == []
    assert _backend(pg_store) == first
    assert pg_store.load_checkpoint("k") == (codec.encode({"row": 19}), 20)


def test_a_second_caller_uses_the_pool_while_the_kept_one_is_busy(pg_store: Store) -> None:
    claim = run(pg_store, "k", owner())
    holding, release = threading.Event(), threading.Event()
    held: list[int] = []

    def hold() -> None:
        with pg_store.single() as conn:
            held.append(int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one()))
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        # not blocked behind the holder: the pool lends another connection
        assert pg_store.save_checkpoint("k", claim.epoch, codec.encode({"row": 1})) == 1
        assert _backend(pg_store) != held[0]
    finally:
        release.set()
        holder.join(10)
    assert not holder.is_alive()
    assert _backend(pg_store) == held[0]  # free again: the kept one


def test_a_use_that_raises_gives_it_back_to_the_pool(pg_store: Store) -> None:
    kept = _backend(pg_store)
    try:
        with pg_store.single():
            raise RuntimeError("the caller's own error")
    except RuntimeError:
        pass
    with pg_store.engines[1].connect() as conn:  # the pool has it again
        assert int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one()) == kept


def _child_backend(store: Store, key: str, epoch: int, out: Any) -> None:
    store.save_checkpoint(key, epoch, codec.encode({"row": "child"}))
    out.put(_backend(store))


def test_a_forked_child_never_uses_its_parent_s(pg_store: Store) -> None:
    claim = run(pg_store, "k", owner())
    parent = _backend(pg_store)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_backend, args=(pg_store, "k", claim.epoch, out))
    child.start()
    child_backend = out.get(timeout=30)
    child.join(30)
    assert child.exitcode == 0
    assert child_backend != parent
    # the child neither used nor closed the parent's session
    assert pg_store.save_checkpoint("k", claim.epoch, codec.encode({"row": 2})) == 2
    assert _backend(pg_store) == parent


def test_dispose_closes_it(pg_store: Store, other: Engine) -> None:
    kept = _backend(pg_store)
    pg_store.dispose()
    wait_for(lambda: not _alive(other, kept), 10, "the kept session to end")


def test_a_store_dropped_without_dispose_closes_it(pg_url: str, table_prefix: str,
                                                   other: Engine) -> None:
    store = Store(pg_url, table_prefix)
    kept = _backend(store)
    del store
    gc.collect()
    wait_for(lambda: not _alive(other, kept), 10, "the kept session to end")


def test_disposed_while_lent_it_is_closed_at_its_next_use(pg_store: Store, other: Engine,
                                                           ) -> None:
    with pg_store.single() as conn:
        kept = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
        pg_store.dispose()  # another thread's shutdown, say: the kept one is in use here
    fresh = _backend(pg_store)  # a new engine: the old connection is not lent again
    assert fresh != kept
    wait_for(lambda: not _alive(other, kept), 10, "the old kept session to end")


def test_after_the_server_ended_every_session_one_retry_meets_a_fresh_connection(
        pg_url: str, table_prefix: str, other: Engine) -> None:
    """A server restart, a failover or a pooler's reset ends the kept session and the pool's
    idle ones alike: the first failure replaces them all, as SQLAlchemy does on a
    disconnect, so the guard's one retry does not meet the next dead one."""
    name = f"kept_{uuid.uuid4().hex[:8]}"
    store = Store(f"{pg_url}{'&' if '?' in pg_url else '?'}application_name={name}",
                  table_prefix)
    try:
        store.migrate()
        claim = run(store, "k", owner())
        autocommit = store.engines[1]
        idle = [autocommit.connect() for _ in range(2)]  # the pool keeps two idle ones
        for conn in idle:
            conn.execute(text("SELECT 1"))
            conn.close()
        _backend(store)  # and the kept one
        with other.connect() as conn:
            ended = conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = :n"), {"n": name}).scalar_one()
            conn.commit()
        assert ended >= 3
        wait_for(lambda: not _sessions(other, name), 10, "the sessions to end")
        assert store.save_checkpoint("k", claim.epoch, codec.encode({"row": 1})) == 1
        store.finish("k", claim.epoch, codec.encode("ok"))
    finally:
        store.dispose()


def _sessions(other: Engine, name: str) -> int:
    with other.connect() as conn:
        found = conn.execute(text("SELECT count(*) FROM pg_stat_activity "
                                  "WHERE application_name = :n"), {"n": name}).scalar_one()
        conn.rollback()
    return int(found)
