"""A store call interrupted mid-statement, as Celery's soft time limit does it (an exception
raised from a signal handler while the driver waits for the server's reply).

The interrupt must reach the caller unchanged (its handlers expect ``SoftTimeLimitExceeded``,
not a store outage that re-sends the task), and the interrupted connection, whose reply is
still unread, must never serve another statement.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import psycopg
import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Engine, select, text

from celery_resilient.core import codec
from celery_resilient.store.sql import Store
from celery_resilient.testing import wait_for

from .helpers import owner, run, started

Interrupted = SoftTimeLimitExceeded  # what Celery's soft time limit raises in a pool process


@pytest.fixture
def alarm() -> Iterator[None]:
    def raise_interrupt(_sig: int, _frame: FrameType | None) -> None:
        raise Interrupted()

    previous = signal.signal(signal.SIGALRM, raise_interrupt)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def _interrupted_while_blocked(store: Store, other: Engine, call: object) -> None:
    """Hold the work row's lock from another client, run ``call`` (it blocks on the lock),
    and interrupt it 0.3 s later; then let the row go."""
    w = store.t.work
    holder = other.connect()
    try:
        holder.execute(select(w.c.epoch).where(w.c.work_key == "k").with_for_update())
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            call()  # type: ignore[operator]
        signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        holder.rollback()
        holder.close()


def _statement_landed(other: Engine, store: Store) -> None:
    """The server finishes what it was sent once the lock goes: wait until nothing of ours
    is still running, so the next call's result does not race it."""
    def idle() -> bool:
        with other.connect() as conn:
            busy = conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                "AND query LIKE :q AND pid <> pg_backend_pid()"),
                {"q": f"%{store.prefix}%"}).scalar_one()
            conn.rollback()
        return busy == 0
    wait_for(idle, 10, "the interrupted statement to finish on the server")


def test_a_checkpoint_save_interrupted_mid_statement_leaves_no_broken_connection(
        pg_store: Store, other: Engine, alarm: None) -> None:
    claim = run(pg_store, "k", owner())
    _interrupted_while_blocked(pg_store, other, lambda: pg_store.save_checkpoint(
        "k", claim.epoch, codec.encode({"row": 1})))
    _statement_landed(other, pg_store)
    # Every later statement of this process works (the broken connection was dropped).
    seq = pg_store.save_checkpoint("k", claim.epoch, codec.encode({"row": 2}))
    assert pg_store.load_checkpoint("k") == (codec.encode({"row": 2}), seq)
    pg_store.finish("k", claim.epoch, codec.encode("ok"))
    row = pg_store.get_work("k")
    assert row is not None and row.state == "done"


def test_a_step_interrupted_mid_transaction_raises_the_interrupt_not_an_outage(
        pg_store: Store, other: Engine, alarm: None) -> None:
    claim = run(pg_store, "k", owner())
    _interrupted_while_blocked(pg_store, other, lambda: pg_store.put_step(
        "k", claim.epoch, "first", codec.encode(1)))
    _statement_landed(other, pg_store)
    assert pg_store.get_step("k", "first") is None  # rolled back with its connection
    pg_store.put_step("k", claim.epoch, "second", codec.encode(2))
    assert pg_store.get_step("k", "second") == codec.encode(2)


@pytest.mark.parametrize("lender", ["transactional", "autocommit", "kept"])
def test_a_pooled_connection_left_mid_statement_is_never_lent_again(
        pg_store: Store, lender: str) -> None:
    """Wherever the interrupt landed (a statement, a COMMIT, the pool's own reset), the
    connection goes back to its pool (or stays the process's kept one, ``store/pinned.py``)
    still waiting for a reply; the next checkout must give a working one."""
    def lend() -> Any:
        if lender == "kept":
            return pg_store.single()
        return pg_store.engines[0 if lender == "transactional" else 1].connect()

    with lend() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.pgconn.send_query(b"SELECT pg_sleep(0.2)")  # sent; its reply never read
        broken = id(raw)
    with lend() as conn:
        assert id(conn.connection.dbapi_connection) != broken
        assert conn.execute(text("SELECT 1")).scalar_one() == 1


def test_a_read_interrupted_while_waiting_raises_the_interrupt_not_an_outage(
        pg_store: Store, other: Engine, alarm: None) -> None:
    """Closing the interrupted read's connection fails too ("another command is already in
    progress"); that cleanup error must not replace the interrupt."""
    claim = run(pg_store, "k", owner())
    pg_store.put_step("k", claim.epoch, "first", codec.encode(1))
    holder = other.connect()
    try:
        holder.execute(text(f"LOCK TABLE {pg_store.prefix}steps IN ACCESS EXCLUSIVE MODE"))
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            pg_store.get_step("k", "first")
        signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        holder.rollback()
        holder.close()
    _statement_landed(other, pg_store)
    assert pg_store.get_step("k", "first") == codec.encode(1)


def test_a_soft_limit_in_the_pool_s_rollback_reaches_the_task(
        pg_url: str, table_prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Celery's soft time limit landing while the pool rolls back a connection it takes
    back: SQLAlchemy logs such an exception and swallows it, and the task went on past its
    limit. The caller of the transaction must see it (the store's work is committed)."""
    store = Store(pg_url, table_prefix)
    store.migrate()
    try:
        me = started(store, owner())
        rollback = psycopg.Connection.rollback
        fired: list[bool] = []

        def interrupted(self: psycopg.Connection[Any]) -> None:
            if not fired:  # once, as the signal handler would
                fired.append(True)
                raise SoftTimeLimitExceeded()
            rollback(self)

        monkeypatch.setattr(psycopg.Connection, "rollback", interrupted)
        with pytest.raises(SoftTimeLimitExceeded), store.begin() as conn:
            conn.execute(text("SELECT 1"))
        assert fired == [True]
        monkeypatch.undo()
        assert store.heartbeat(me, 30) is True  # the next call runs, nothing left pending
    finally:
        store.dispose()
