"""Transient database errors are a store outage, never a task's failure.

Each class is provoked for real on the machine's PostgreSQL (and SQLite where it applies): a
serialization failure between two SERIALIZABLE transactions, a deadlock of two connections
locking rows in opposite order, ``pg_terminate_backend`` of the store's own backend, an
``idle_in_transaction_session_timeout`` that runs out inside the block, and a SQLite write lock
held by another connection past a short busy timeout. Either the store re-runs what is safe to
re-run and succeeds, or it raises :class:`StoreUnavailable` (naming the operation and the
SQLSTATE); an atomic block never commits half of itself.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from celery.exceptions import WorkerShutdown
from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError, StatementError

from celery_resilient.core import codec
from celery_resilient.errors import StoreUnavailable
from celery_resilient.store import engine as engine_module
from celery_resilient.store import transient
from celery_resilient.store.sql import Store, guarded
from celery_resilient.tasks.ledger import Ledger
from celery_resilient.testing import wait_for
from celery_resilient.testing.services import free_port

from .helpers import execution, owner, run, take

pytestmark = pytest.mark.postgres
#: libpq options: every transaction of this store's connections is SERIALIZABLE (as a site
#: running its database serializable by default would have it).
SERIALIZABLE = "?options=-c%20default_transaction_isolation%3Dserializable"
DEADLINE = 30.0


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def serial_store(pg_url: str, table_prefix: str, pg_store: Store) -> Iterator[Store]:
    """The same tables as ``pg_store``, through connections that run SERIALIZABLE."""
    s = Store(pg_url + SERIALIZABLE, table_prefix)
    yield s
    s.dispose()


@pytest.fixture
def sqlite_store(tmp_path: Any, table_prefix: str,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A SQLite store whose busy timeout is 0.2 s instead of 30 s, so a held lock shows soon."""
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", 200)
    s = Store(f"sqlite:///{tmp_path}/store.sqlite3", table_prefix)
    s.migrate()
    yield s
    s.dispose()


def _counter(store: Store) -> Table:
    """A table of the user's own in the store's database (dropped with the prefix)."""
    table = Table(f"{store.prefix}counter", MetaData(),
                  Column("id", Integer, primary_key=True),
                  Column("n", Integer, nullable=False),
                  Column("note", String(50), nullable=True))
    table.metadata.create_all(store.engine)
    with store.engine.begin() as conn:
        conn.execute(table.insert(), [{"id": 1, "n": 0}, {"id": 2, "n": 0}])
    return table


def _counts(store: Store, table: Table) -> dict[int, int]:
    with store.engine.connect() as conn:
        rows = {int(r.id): int(r.n) for r in conn.execute(select(table.c.id, table.c.n))}
        conn.rollback()
    return rows


def _backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _waiting_on(other: Engine, holder_pid: int) -> list[int]:
    """Backends blocked on a lock ``holder_pid`` holds (read afresh: no stats snapshot)."""
    with other.connect() as conn:
        pids = [int(p) for p in conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE :h = ANY(pg_blocking_pids(pid))"),
            {"h": holder_pid}).scalars()]
        conn.rollback()
    return pids


def _backend_gone(other: Engine, pid: int) -> bool:
    with other.connect() as conn:
        n = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                         {"p": pid}).scalar_one()
        conn.rollback()
    return int(n) == 0


class _InThread:
    """Run ``fn`` in a thread; ``result()`` joins with a deadline and re-raises its error."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # handed to the test thread by result()
                self.error = exc

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def result(self, timeout: float = DEADLINE) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "thread did not finish before its deadline"
        if self.error is not None:
            raise self.error
        return self.value


class _Reruns(logging.Handler):
    """Counts the store's "running it again" log records; ``seen`` is set at the first."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "action", None) == "store_rerun":
            self.records.append(record)
            self.seen.set()


@pytest.fixture
def reruns() -> Iterator[_Reruns]:
    handler = _Reruns()
    logger = logging.getLogger("celery_resilient.store.guard")  # the retry guard logs reruns
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old_level)


# -- the classification -----------------------------------------------------------------------


def test_non_transient_errors_are_not_classified_transient(pg_store: Store) -> None:
    table = _counter(pg_store)
    with pytest.raises(IntegrityError) as caught, pg_store.engine.begin() as conn:
        conn.execute(table.insert().values(id=1, n=5))
    assert transient.sqlstate(caught.value) == "23505"
    assert not transient.is_transient(caught.value)
    assert not transient.is_transient(ValueError("a bug"))


READ_ONLY = "?options=-c%20default_transaction_read_only%3Don"


def test_a_read_only_server_is_an_outage_not_the_tasks_failure(
        pg_url: str, table_prefix: str, pg_store: Store) -> None:
    """What a client sees for a moment during a failover (it reached a standby): SQLSTATE
    25006. The take must not fail the task (its message would be acked and the work lost):
    it is an outage, the task is re-sent and runs once the primary takes writes."""
    read_only = Store(pg_url + READ_ONLY, table_prefix)
    try:
        with pytest.raises(StoreUnavailable, match=r"read-only transaction.*25006") as caught:
            take(read_only, "k", owner())
        assert transient.is_transient(caught.value.__cause__)
        assert pg_store.get_work("k") is None  # nothing was written
    finally:
        read_only.dispose()
    assert run(pg_store, "k", owner()).epoch == 1  # the writable server takes it


def test_an_interrupt_wrapped_by_sqlalchemy_reaches_the_caller_unchanged() -> None:
    """SQLAlchemy wraps an exception raised inside its own code while it prepares a
    statement (a soft time limit landing there) in ``StatementError``; a store call re-raises
    the interrupt itself, which is what the task's handlers catch."""
    @guarded
    def call() -> None:
        raise StatementError("interrupted", "SELECT 1", {}, SoftTimeLimitExceeded())

    with pytest.raises(SoftTimeLimitExceeded):
        call()


@pytest.mark.parametrize("handling", [WorkerShutdown(0), SoftTimeLimitExceeded()],
                         ids=["celery-warm-shutdown", "task-handling-its-soft-limit"])
def test_an_exception_the_caller_was_handling_is_not_taken_for_an_interrupt(
        table_prefix: str, handling: BaseException) -> None:
    """Celery's warm shutdown runs the worker's stop steps inside ``except SystemExit`` (its
    ``WorkerShutdown``), and a task may save a checkpoint inside ``except
    SoftTimeLimitExceeded``; every error a store call raises there is chained to what is being
    handled. A store that does not answer then is an outage (the caller logs it or re-sends
    the task), never that exception again: re-raised out of the shutdown step, it cut the
    shutdown short and the worker hung at exit with its pool never joined (the chaos soak)."""
    down = Store(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/postgres", table_prefix)
    try:
        try:
            raise handling
        except BaseException:
            with pytest.raises(StoreUnavailable, match=r"unreachable during Store\.mark_draining"):
                down.mark_draining(owner())
    finally:
        down.dispose()


# -- ledger.atomic on PostgreSQL: the block cannot be re-run in place ---------------------------


def test_serialization_failure_in_atomic_is_unavailable_and_rolls_back_all(
        serial_store: Store, other: Engine) -> None:
    counter = _counter(serial_store)
    x = execution(serial_store, run(serial_store, "k", owner()))
    with pytest.raises(StoreUnavailable, match=r"ledger\.atomic\('k:atomic'\).*40001"), \
            Ledger(serial_store, x).atomic() as tx:
        tx.execute(text(f"INSERT INTO {counter.name} (id, n, note) VALUES (3, 0, 'mine')"))
        seen = tx.execute(select(counter.c.n).where(counter.c.id == 1)).scalar_one()
        with other.begin() as conn:  # a concurrent writer commits first
            conn.execute(update(counter).where(counter.c.id == 1).values(n=counter.c.n + 10))
        tx.execute(update(counter).where(counter.c.id == 1).values(n=seen + 1))
        tx.result = "never committed"
    assert _counts(serial_store, counter) == {1: 10, 2: 0}  # not our insert, not our update
    assert serial_store.ledger_get("k:atomic") is None
    # The re-run (the re-sent task) finds the key not applied and writes once.
    with Ledger(serial_store, x).atomic() as tx:
        assert tx.applied is False
        tx.execute(update(counter).where(counter.c.id == 1).values(n=counter.c.n + 1))
        tx.result = "once"
    assert _counts(serial_store, counter) == {1: 11, 2: 0}
    assert codec.decode(serial_store.ledger_get("k:atomic")) == "once"


def test_serialization_failure_at_commit_is_unavailable_and_never_rerun(
        serial_store: Store, pg_url: str) -> None:
    """Write skew: both transactions read the table, both insert; the other commits first and
    ours fails at COMMIT. A failure at commit has an unknown outcome: never re-run in place,
    though 40001 is otherwise re-run (the marker decides at the task's re-run)."""
    counter = _counter(serial_store)
    serial_other = create_engine(pg_url + SERIALIZABLE)
    calls: list[str] = []

    @guarded
    def write_skew(store: Store) -> None:
        calls.append("call")
        concurrent = serial_other.connect()
        try:
            with store.begin() as conn:
                conn.execute(select(func.sum(counter.c.n))).scalar_one()
                concurrent.execute(select(func.sum(counter.c.n))).scalar_one()
                conn.execute(counter.insert().values(id=10, n=1, note="mine"))
                concurrent.execute(counter.insert().values(id=11, n=1, note="theirs"))
                concurrent.commit()
        finally:
            concurrent.close()

    try:
        with pytest.raises(StoreUnavailable,
                           match=r"at commit of .*write_skew, outcome unknown.*40001"):
            write_skew(serial_store)
    finally:
        serial_other.dispose()
    assert calls == ["call"]
    with serial_store.engine.connect() as conn:
        notes = sorted(conn.execute(select(counter.c.note).where(counter.c.note.is_not(None)))
                       .scalars())
        conn.rollback()
    assert notes == ["theirs"]


def test_deadlock_in_atomic_is_unavailable_and_rolls_back_all(pg_store: Store,
                                                              other: Engine) -> None:
    """Two connections lock rows 1 and 2 in opposite order; ours waits first, so ours is the
    victim (the other sets a long ``deadlock_timeout`` and never runs the check first)."""
    counter = _counter(pg_store)
    x = execution(pg_store, run(pg_store, "k", owner()))
    holder = other.connect()
    try:
        holder.exec_driver_sql("SET deadlock_timeout = '20s'")
        holder.execute(update(counter).where(counter.c.id == 2).values(n=counter.c.n + 100))
        holder_pid = _backend_pid(holder)
        with pytest.raises(StoreUnavailable, match=r"ledger\.atomic\('k:atomic'\).*40P01"), \
                Ledger(pg_store, x).atomic() as tx:
            mine = _backend_pid(tx.connection)
            tx.execute(update(counter).where(counter.c.id == 1).values(n=counter.c.n + 1))

            def close_the_cycle() -> None:
                wait_for(lambda: mine in _waiting_on(other, holder_pid), DEADLINE,
                         "the atomic block to wait on row 2")
                holder.execute(update(counter).where(counter.c.id == 1)
                               .values(n=counter.c.n + 100))  # waits until ours is aborted

            closer = _InThread(close_the_cycle)
            try:
                tx.execute(update(counter).where(counter.c.id == 2).values(n=counter.c.n + 1))
            finally:
                closer.thread.join(DEADLINE)
        closer.result()
        holder.commit()
    finally:
        holder.close()
    assert _counts(pg_store, counter) == {1: 100, 2: 100}  # the other's writes, none of ours
    assert pg_store.ledger_get("k:atomic") is None


def test_killed_backend_in_atomic_is_unavailable_and_the_store_recovers(
        pg_store: Store, other: Engine) -> None:
    counter = _counter(pg_store)
    x = execution(pg_store, run(pg_store, "k", owner()))
    with pytest.raises(StoreUnavailable, match=r"ledger\.atomic\('k:atomic'\).*57P01"), \
            Ledger(pg_store, x).atomic() as tx:
        tx.execute(update(counter).where(counter.c.id == 1).values(n=7))
        with other.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:p)"),
                         {"p": _backend_pid(tx.connection)})
        tx.execute(update(counter).where(counter.c.id == 2).values(n=7))
    assert _counts(pg_store, counter) == {1: 0, 2: 0}
    assert pg_store.ledger_get("k:atomic") is None
    with Ledger(pg_store, x).atomic() as tx:  # a fresh connection: the store is usable
        assert tx.applied is False
        tx.execute(update(counter).where(counter.c.id == 1).values(n=7))
    assert _counts(pg_store, counter) == {1: 7, 2: 0}


def test_idle_in_transaction_timeout_in_atomic_is_unavailable_and_rolls_back_all(
        pg_store: Store, other: Engine) -> None:
    counter = _counter(pg_store)
    x = execution(pg_store, run(pg_store, "k", owner()))
    with pytest.raises(StoreUnavailable, match=r"ledger\.atomic\('k:atomic'\).*25P03"), \
            Ledger(pg_store, x).atomic() as tx:
        tx.execute(text("SET idle_in_transaction_session_timeout = '200ms'"))
        tx.execute(update(counter).where(counter.c.id == 1).values(n=7))
        pid = _backend_pid(tx.connection)
        # The block stays in its transaction past the timeout: the server ends the session.
        wait_for(lambda: _backend_gone(other, pid), DEADLINE, "the idle session to be ended")
    assert _counts(pg_store, counter) == {1: 0, 2: 0}
    assert pg_store.ledger_get("k:atomic") is None


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_users_own_integrity_error_in_atomic_propagates_unchanged(
        dialect: str, pg_store: Store, sqlite_store: Store) -> None:
    store = sqlite_store if dialect == "sqlite" else pg_store
    counter = _counter(store)
    x = execution(store, run(store, "k", owner()))
    with pytest.raises(IntegrityError), Ledger(store, x).atomic() as tx:
        tx.execute(update(counter).where(counter.c.id == 2).values(n=5))
        tx.execute(counter.insert().values(id=1, n=1))  # duplicate key: the user's bug
    assert _counts(store, counter) == {1: 0, 2: 0}
    assert store.ledger_get("k:atomic") is None


# -- the store's own operations on PostgreSQL: re-run when safe --------------------------------


def _checkpoint_blocked_then_conflicting(serial_store: Store, other: Engine) -> _InThread:
    """Start a fenced checkpoint save while another transaction updates the claim row and
    commits: the waiting SERIALIZABLE statement then fails with 40001 (concurrent update)."""
    claim = run(serial_store, "k", owner())
    w = serial_store.t.work
    holder = other.connect()
    try:
        holder.execute(update(w).where(w.c.work_key == "k").values(updated_at=w.c.updated_at))
        holder_pid = _backend_pid(holder)
        saver = _InThread(lambda: serial_store.save_checkpoint(
            "k", claim.epoch, codec.encode({"row": 1})))
        wait_for(lambda: _waiting_on(other, holder_pid), DEADLINE,
                 "the checkpoint save to wait on the claim row")
        holder.commit()
    finally:
        holder.close()
    return saver


def test_store_operation_is_rerun_after_a_serialization_failure(
        serial_store: Store, other: Engine, reruns: _Reruns) -> None:
    saver = _checkpoint_blocked_then_conflicting(serial_store, other)
    assert saver.result() == 1  # written once, on the re-run
    assert serial_store.load_checkpoint("k") == (codec.encode({"row": 1}), 1)
    assert [r.getMessage() for r in reruns.records] == [
        "serialization failure (SQLSTATE 40001) during Store.save_checkpoint; "
        "running it again (1/3)"]


def test_store_operation_still_failing_is_unavailable_naming_it(
        serial_store: Store, other: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transient, "RETRIES", 0)  # no re-run left: the first failure is final
    saver = _checkpoint_blocked_then_conflicting(serial_store, other)
    with pytest.raises(StoreUnavailable,
                       match=r"during Store\.save_checkpoint \(serialization failure "
                             r"\(SQLSTATE 40001\)\)"):
        saver.result()
    assert serial_store.load_checkpoint("k") is None


def test_killed_backend_during_store_operation_is_rerun_on_a_fresh_connection(
        pg_store: Store, other: Engine) -> None:
    claim = run(pg_store, "k", owner())
    w = pg_store.t.work
    holder = other.connect()
    try:
        holder.execute(select(w.c.epoch).where(w.c.work_key == "k").with_for_update())
        holder_pid = _backend_pid(holder)
        saver = _InThread(lambda: pg_store.save_checkpoint(
            "k", claim.epoch, codec.encode({"row": 1})))
        first = wait_for(lambda: _waiting_on(other, holder_pid), DEADLINE,
                         "the checkpoint save to wait on the claim row")[0]
        with other.begin() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": first})
        wait_for(lambda: [p for p in _waiting_on(other, holder_pid) if p != first], DEADLINE,
                 "the re-run on a fresh connection to wait on the claim row")
        holder.rollback()
    finally:
        holder.close()
    assert saver.result() == 1
    assert pg_store.load_checkpoint("k") == (codec.encode({"row": 1}), 1)


def test_a_call_that_already_committed_is_never_rerun(serial_store: Store,
                                                      other: Engine) -> None:
    """A guarded call running two transactions: once the first committed, a serialization
    failure in the second is StoreUnavailable (re-running would repeat the first)."""
    counter = _counter(serial_store)
    calls: list[str] = []

    @guarded
    def two_transactions(store: Store, commit_first: bool) -> None:
        calls.append("call")
        if commit_first:
            with store.begin() as conn:
                conn.execute(update(counter).where(counter.c.id == 2).values(n=counter.c.n + 1))
        with store.begin() as conn:
            seen = conn.execute(select(counter.c.n).where(counter.c.id == 1)).scalar_one()
            if len(calls) == 1:  # a concurrent writer, on the first call only
                with other.begin() as c:
                    c.execute(update(counter).where(counter.c.id == 1).values(n=counter.c.n + 10))
            conn.execute(update(counter).where(counter.c.id == 1).values(n=seen + 1))

    with pytest.raises(StoreUnavailable, match=r"two_transactions.*40001"):
        two_transactions(serial_store, True)
    assert calls == ["call"]
    assert _counts(serial_store, counter) == {1: 10, 2: 1}

    calls.clear()
    two_transactions(serial_store, False)  # nothing committed before the failure: re-run
    assert calls == ["call", "call"]
    assert _counts(serial_store, counter) == {1: 21, 2: 1}


# -- SQLite: another connection holds the write lock -------------------------------------------


def _hold_write_lock(store: Store) -> sqlite3.Connection:
    """Another process's writer, as a raw connection: BEGIN IMMEDIATE takes the write lock."""
    database = store.engine.url.database
    assert database is not None
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_sqlite_busy_store_operation_is_unavailable_naming_it(sqlite_store: Store,
                                                              reruns: _Reruns) -> None:
    holder = _hold_write_lock(sqlite_store)
    try:
        with pytest.raises(StoreUnavailable,
                           match=r"during Store\.ledger_put \(SQLITE_BUSY\): database is locked"):
            sqlite_store.ledger_put("invoice:1", None, None, '"sent"')
    finally:
        holder.rollback()
        holder.close()
    assert len(reruns.records) == transient.RETRIES
    assert sqlite_store.ledger_get("invoice:1") is None


def test_sqlite_busy_store_operation_succeeds_when_rerun(sqlite_store: Store,
                                                         reruns: _Reruns) -> None:
    holder = _hold_write_lock(sqlite_store)

    def release_at_first_rerun() -> None:
        assert reruns.seen.wait(DEADLINE), "the store never re-ran the busy operation"
        holder.rollback()

    releaser = _InThread(release_at_first_rerun)
    try:
        assert sqlite_store.ledger_put("invoice:1", None, None, '"sent"') is True
        releaser.result()
    finally:
        holder.close()
    assert sqlite_store.ledger_get("invoice:1") == '"sent"'
    assert 1 <= len(reruns.records) <= transient.RETRIES


def test_sqlite_busy_atomic_is_unavailable_with_nothing_written(sqlite_store: Store) -> None:
    counter = _counter(sqlite_store)
    x = execution(sqlite_store, run(sqlite_store, "k", owner()))
    body: list[str] = []
    holder = _hold_write_lock(sqlite_store)
    try:
        with pytest.raises(StoreUnavailable, match=r"ledger\.atomic\('k:atomic'\).*SQLITE_BUSY"), \
                Ledger(sqlite_store, x).atomic() as tx:
            body.append("ran")
            tx.execute(update(counter).where(counter.c.id == 1).values(n=1))
    finally:
        holder.rollback()
        holder.close()
    assert body == []  # the transaction never began: the block did not run
    assert _counts(sqlite_store, counter) == {1: 0, 2: 0}
    assert sqlite_store.ledger_get("k:atomic") is None


def test_store_connections_bound_how_long_a_partition_can_hang(pg_url: str,
                                                                 table_prefix: str) -> None:
    """A statement sent to a server lost behind a network partition would wait for the
    kernel's retransmissions (about 15 minutes), holding the task and any warm shutdown
    behind it. Every store connection carries TCP keepalives and ``tcp_user_timeout``, so it
    fails as an outage within about 30 s instead; a value given in the URL wins."""
    url = pg_url + ("&" if "?" in pg_url else "?") + "keepalives_idle=7"
    store = Store(url, table_prefix)
    try:
        for engine in store.engines:
            with engine.connect() as conn:
                params = conn.connection.dbapi_connection.info.get_parameters()  # type: ignore[union-attr]
                conn.rollback()
            assert {k: params.get(k) for k in engine_module.PARTITION_TIMEOUTS} == {
                "keepalives": "1", "keepalives_idle": "7", "keepalives_interval": "5",
                "keepalives_count": "3", "tcp_user_timeout": "30000"}
    finally:
        store.dispose()
