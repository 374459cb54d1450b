"""Automatic retention: bounded deletes of what the store no longer needs.

Every test runs on SQLite and PostgreSQL. Rows are written with chosen ages on the database's
clock; what is older than its retention goes, in batches of at most ``batch`` rows, and what
is open, young or live stays.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import create_engine, func, insert, select, text
from sqlalchemy.exc import DBAPIError

from celery_resilient import Resilient, signals
from celery_resilient.core.identity import Owner
from celery_resilient.errors import StoreUnavailable
from celery_resilient.store import retention
from celery_resilient.store.admin_queries import AdminQueries
from celery_resilient.store.operator_queries import prune_workers
from celery_resilient.store.sql import Store
from celery_resilient.testing import wait_for
from celery_resilient.worker.maintainer import Maintainer
from celery_resilient.worker.pruner import Pruner

DAY = 86_400.0
LEASE = 30.0


# -- helpers ------------------------------------------------------------------------------------

def add_work(store: Store, key: str, state: str, age: float, *, steps: int = 2,
             incarnation: str | None = None) -> None:
    """A work row (finished ``age`` seconds ago when it ended), its checkpoint and steps."""
    now = store.now()
    ended = state not in ("reserved", "running", "requeued")
    with store.begin() as conn:
        conn.execute(insert(store.t.work).values(
            work_key=key, task_name="t.task", task_id=f"tid-{key}", state=state, epoch=1,
            incarnation=incarnation, created_at=now - age - 10, updated_at=now - age,
            finished_at=now - age if ended else None,
            lease_expires_at=None if ended else now + LEASE,
            checkpoint_json="{}", checkpoint_seq=1, checkpoint_epoch=1, checkpoint_at=now - age))
        for i in range(steps):
            conn.execute(insert(store.t.steps).values(
                work_key=key, name=f"s{i}", epoch=1, result_json="1", created_at=now - age))


def add_ledger(store: Store, key: str, age: float, work_key: str | None = None) -> None:
    with store.begin() as conn:
        conn.execute(insert(store.t.ledger).values(
            key=key, work_key=work_key, epoch=1, result_json="1",
            applied_at=store.now() - age))


def add_worker(store: Store, incarnation: str, heartbeat_age: float,
               stopped_age: float | None = None) -> None:
    now = store.now()
    with store.begin() as conn:
        conn.execute(insert(store.t.workers).values(
            incarnation=incarnation, node=f"{incarnation}@host", pid=1,
            started_at=now - heartbeat_age - 60, heartbeat_at=now - heartbeat_age,
            stopped_at=None if stopped_age is None else now - stopped_age,
            lease_expires_at=now - heartbeat_age + LEASE if stopped_age is None
            else now - stopped_age))


def keys(store: Store, table: str, column: str) -> set[str]:
    t = getattr(store.t, table)
    with store.engine.connect() as conn:
        found = {str(k) for k in conn.execute(select(t.c[column])).scalars()}
        conn.rollback()
    return found


def checkpointed(store: Store) -> set[str]:
    """The keys whose work row holds a checkpoint."""
    w = store.t.work
    with store.engine.connect() as conn:
        found = {str(k) for k in conn.execute(
            select(w.c.work_key).where(w.c.checkpoint_json.is_not(None))).scalars()}
        conn.rollback()
    return found


def count(store: Store, table: str) -> int:
    t = getattr(store.t, table)
    with store.engine.connect() as conn:
        n = int(conn.execute(select(func.count()).select_from(t)).scalar_one())
        conn.rollback()
    return n


def cutoff(store: Store, age: float) -> float:
    return store.now() - age


# -- the store's deletes ----------------------------------------------------------------------

def test_old_ended_work_goes_with_its_checkpoint_and_steps(store: Store) -> None:
    add_work(store, "old-done", "done", 10 * DAY)
    add_work(store, "old-failed", "failed", 9 * DAY)
    add_work(store, "old-dead", "dead", 8 * DAY)
    add_work(store, "young-done", "done", 1 * DAY)
    add_work(store, "open-running", "running", 30 * DAY)  # old, but open
    add_work(store, "open-requeued", "requeued", 30 * DAY)

    done = retention.delete_finished_work(store, cutoff(store, 7 * DAY), 500)

    assert done == retention.WorkPruned(work=3, checkpoints=3, steps=6)
    kept = {"young-done", "open-running", "open-requeued"}
    assert keys(store, "work", "work_key") == kept
    assert checkpointed(store) == kept
    assert keys(store, "steps", "work_key") == kept


def test_checkpoints_and_steps_of_work_not_deleted_stay(store: Store) -> None:
    """A checkpoint or step whose work row is young, open, or absent is never touched."""
    add_work(store, "young", "done", 60)
    add_work(store, "open", "running", 30 * DAY)
    with store.begin() as conn:  # a step with no work row (nothing deletes it by work)
        conn.execute(insert(store.t.steps).values(
            work_key="no-work", name="s", epoch=1, result_json="1", created_at=0.0))
    assert retention.delete_finished_work(store, cutoff(store, DAY), 500) == retention.WorkPruned()
    assert checkpointed(store) == {"young", "open"}
    assert count(store, "steps") == 5


def test_each_call_deletes_at_most_one_batch(store: Store) -> None:
    for i in range(23):
        add_work(store, f"w{i:02d}", "done", 10 * DAY, steps=1)
        add_ledger(store, f"l{i:02d}", 40 * DAY)
    cut = cutoff(store, 7 * DAY)
    assert [retention.delete_finished_work(store, cut, 10).work for _ in range(4)] == [10, 10, 3, 0]
    assert count(store, "steps") == 0
    cut = cutoff(store, 30 * DAY)
    assert [retention.delete_ledger_markers(store, cut, 10) for _ in range(4)] == [10, 10, 3, 0]


PRUNE_LOOP = """
import sys
from celery_resilient.store.retention import delete_finished_work
from celery_resilient.store.sql import Store
store = Store(sys.argv[1], sys.argv[2])
while (n := delete_finished_work(store, store.now(), 10).work):
    print(n, flush=True)
"""


def test_a_sigkill_inside_a_prune_batch_loses_none_of_it(store: Store) -> None:
    """A process SIGKILLed inside a batch's transaction (work rows deleted, their steps not
    yet: the ``mid_prune`` kill point) deletes nothing of that batch: every work row left
    keeps its checkpoint and steps, and the next prune finishes the job."""
    for i in range(40):
        add_work(store, f"w{i:02d}", "done", 10 * DAY, steps=2)
    env = {**os.environ, "RESILIENT_KILL_AT": "mid_prune:3", "RESILIENT_KILL_SCOPE": "process"}
    proc = subprocess.run([sys.executable, "-c", PRUNE_LOOP, store.url, store.prefix],
                          check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert proc.stdout.split() == ["10", "10"]  # two batches committed, the third killed
    assert count(store, "work") == 20
    left = keys(store, "work", "work_key")
    assert checkpointed(store) == keys(store, "steps", "work_key") == left
    assert count(store, "steps") == 40
    assert retention.delete_finished_work(store, cutoff(store, DAY), 500) == retention.WorkPruned(
        work=20, checkpoints=20, steps=40)


def test_oldest_rows_go_first(store: Store) -> None:
    for i in range(5):
        add_work(store, f"w{i}", "done", (10 + i) * DAY, steps=0)
    retention.delete_finished_work(store, cutoff(store, 7 * DAY), 2)
    assert keys(store, "work", "work_key") == {"w0", "w1", "w2"}


def test_ledger_markers_stay_until_their_own_retention(store: Store) -> None:
    add_work(store, "open", "running", 60 * DAY)
    add_ledger(store, "effect:old", 40 * DAY)
    add_ledger(store, "effect:young", 10 * DAY)  # past work retention, not ledger retention
    add_ledger(store, "effect:of-open-work", 40 * DAY, work_key="open")
    add_ledger(store, "effect:of-pruned-work", 40 * DAY, work_key="gone")

    assert retention.delete_ledger_markers(store, cutoff(store, 30 * DAY), 500) == 2
    assert keys(store, "ledger", "key") == {"effect:young", "effect:of-open-work"}


def test_live_workers_and_workers_owning_open_work_stay(store: Store) -> None:
    add_worker(store, "live", heartbeat_age=1)
    add_worker(store, "live-quiet", heartbeat_age=20)  # lease not expired yet
    add_worker(store, "stopped-long-ago", heartbeat_age=10 * DAY, stopped_age=10 * DAY)
    add_worker(store, "killed-long-ago", heartbeat_age=10 * DAY)  # lease ran out long ago
    add_worker(store, "stopped-recently", heartbeat_age=2 * DAY, stopped_age=1 * DAY)
    add_worker(store, "gone-with-open-work", heartbeat_age=10 * DAY, stopped_age=10 * DAY)
    add_work(store, "held", "reserved", 10 * DAY, incarnation="gone-with-open-work")

    assert retention.delete_ended_workers(store, cutoff(store, 7 * DAY), LEASE, 500) == 2
    assert keys(store, "workers", "incarnation") == {
        "live", "live-quiet", "stopped-recently", "gone-with-open-work"}


def test_revocations_beat_runs_and_contexts(store: Store) -> None:
    now = store.now()
    with store.begin() as conn:
        conn.execute(insert(store.t.revocations), [
            {"task_id": "tid-open", "created_at": now - 10 * DAY},  # its work is open
            {"task_id": "tid-old", "created_at": now - 10 * DAY},
            {"task_id": "tid-young", "created_at": now - 60}])
        conn.execute(insert(store.t.schedule_runs), [
            {"entry": "e", "slot": float(i), "state": state, "task_id": f"b{i}",
             "claimed_at": now - age}
            for i, (state, age) in enumerate([("sent", 10 * DAY), ("skipped", 10 * DAY),
                                              ("claimed", 10 * DAY), ("sent", 60)])])
        conn.execute(insert(store.t.contexts), [
            {"key": "c-old", "version": 1, "data_json": "{}", "updated_at": now - 10 * DAY},
            {"key": "c-young", "version": 1, "data_json": "{}", "updated_at": now - 60}])
    add_work(store, "open", "running", 10 * DAY, steps=0)
    with store.begin() as conn:
        conn.execute(store.t.work.update().values(task_id="tid-open"))

    cut = cutoff(store, 7 * DAY)
    assert retention.delete_revocations(store, cut, 500) == 1
    assert keys(store, "revocations", "task_id") == {"tid-open", "tid-young"}
    assert retention.delete_beat_runs(store, cut, 500) == 2
    assert keys(store, "schedule_runs", "task_id") == {"b2", "b3"}  # claimed slots stay
    assert retention.delete_contexts(store, cut, 500) == ["c-old"]
    assert keys(store, "contexts", "key") == {"c-young"}


def test_the_operator_prune_uses_the_same_deletes(store: Store) -> None:
    for i in range(7):
        add_work(store, f"w{i}", "done", 10 * DAY, steps=1)
    add_work(store, "open", "running", 10 * DAY)
    add_worker(store, "gone", heartbeat_age=10 * DAY, stopped_age=10 * DAY)
    add_worker(store, "live", heartbeat_age=1)
    planned = AdminQueries(store).prune_counts(7 * DAY)
    counts = AdminQueries(store).prune(7 * DAY, batch=3)
    assert counts == planned
    assert (counts.work, counts.checkpoints, counts.steps) == (7, 7, 7)
    assert prune_workers(store, 7 * DAY, LEASE, batch=1) == 1
    assert keys(store, "work", "work_key") == {"open"}
    assert keys(store, "workers", "incarnation") == {"live"}


# -- the maintainer's pruner ------------------------------------------------------------------

@pytest.fixture
def resilient(store_url: str, table_prefix: str) -> Iterator[Resilient]:
    app = Celery(f"ret-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url=store_url, resilient_table_prefix=table_prefix,
                    resilient_auto_migrate=True, resilient_prune_batch=4,
                    resilient_store_retry_base=0.05,
                    resilient_work_retention=7 * DAY, resilient_ledger_retention=30 * DAY,
                    resilient_worker_row_retention=7 * DAY, resilient_prune_interval=0.2,
                    resilient_lease_seconds=LEASE)
    rt = Resilient(app)
    yield rt
    rt.store.dispose()


@pytest.fixture
def pruned() -> Iterator[list[tuple[str, int]]]:
    got: list[tuple[str, int]] = []

    def receiver(sender: Any = None, table: str = "", rows: int = 0, **_: Any) -> None:
        assert sender == table
        got.append((table, rows))

    signals.rows_pruned.connect(receiver, weak=False)
    yield got
    signals.rows_pruned.disconnect(receiver)


def fill(store: Store) -> None:
    for i in range(10):
        add_work(store, f"old{i}", "done", 10 * DAY)
    add_work(store, "young", "done", 60)
    add_work(store, "open", "running", 10 * DAY)
    for i in range(6):
        add_ledger(store, f"ledger-old{i}", 40 * DAY)
    add_ledger(store, "ledger-young", 10 * DAY)
    add_worker(store, "gone", heartbeat_age=10 * DAY, stopped_age=10 * DAY)
    add_worker(store, "live", heartbeat_age=1)


def assert_pruned(store: Store) -> None:
    assert keys(store, "work", "work_key") == {"young", "open"}
    assert checkpointed(store) == {"young", "open"}
    assert keys(store, "ledger", "key") == {"ledger-young"}
    assert keys(store, "workers", "incarnation") == {"live"}


def test_a_round_goes_on_over_turns_in_batches_and_signals_each(
        resilient: Resilient, pruned: list[tuple[str, int]]) -> None:
    store = resilient.store
    fill(store)
    pruner = Pruner(resilient)
    turns = 0
    while turns == 0 or pruner.busy:
        pruner.turn()
        turns += 1
        assert turns < 50
    assert_pruned(store)
    assert all(0 < rows <= 8 for _, rows in pruned)  # batch 4 (steps: 2 per work row)
    by_table: dict[str, int] = {}
    for table, rows in pruned:
        by_table[table] = by_table.get(table, 0) + rows
    assert by_table == {"work": 10, "steps": 20, "ledger": 6, "workers": 1}
    assert pruner.rounds == 1 and pruner.next_round is not None


def test_a_turn_is_bounded_in_time(resilient: Resilient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn stops after PRUNE_TURN_SECONDS: the round goes on at the next turn."""
    store = resilient.store
    fill(store)
    monkeypatch.setattr("celery_resilient.worker.pruner.PRUNE_TURN_SECONDS", 0.0)
    pruner = Pruner(resilient)
    pruner.turn()  # one batch (of the first table), then the budget is spent
    assert pruner.busy
    assert count(store, "work") == 12 - 4


def test_store_down_during_a_round_keeps_the_round_for_later(
        resilient: Resilient, monkeypatch: pytest.MonkeyPatch) -> None:
    store = resilient.store
    fill(store)
    real = retention.delete_finished_work
    monkeypatch.setattr(retention, "delete_finished_work", _unavailable)
    pruner = Pruner(resilient)
    with pytest.raises(StoreUnavailable):
        pruner.turn()
    monkeypatch.setattr(retention, "delete_finished_work", real)
    while pruner.busy or pruner.rounds == 0:
        pruner.turn()
    assert_pruned(store)


def _unavailable(*_: Any, **__: Any) -> Any:
    raise StoreUnavailable("store unreachable during delete_finished_work (test)")


def test_a_batch_the_server_cancels_for_a_statement_timeout_is_halved(
        resilient: Resilient, monkeypatch: pytest.MonkeyPatch, pg_url: str) -> None:
    """A ``statement_timeout`` shorter than one batch: the batch shrinks until it fits,
    instead of the same batch failing every turn for ever."""
    store = resilient.store
    fill(store)
    real = retention.delete_finished_work
    sizes: list[int] = []
    timeout = create_engine(pg_url, connect_args={"options": "-c statement_timeout=10"})

    def slow_unless_small(st: Store, cutoff: float, batch: int) -> Any:
        sizes.append(batch)
        if batch > 30:  # a real cancellation by the server (SQLSTATE 57014)
            try:
                with timeout.connect() as conn:
                    conn.execute(text("SELECT pg_sleep(1)"))
            except DBAPIError as exc:
                raise StoreUnavailable("store unreachable during delete_finished_work "
                                       f"({exc.orig})") from exc
        return real(st, cutoff, batch)

    monkeypatch.setattr(retention, "delete_finished_work", slow_unless_small)
    pruner = Pruner(resilient)
    assert pruner.batch == 4  # resilient_prune_batch
    pruner.batch = 200  # as if it were set to 200
    try:
        for _ in range(10):
            try:
                pruner.turn()
            except StoreUnavailable:
                continue
            if not pruner.busy:
                break
    finally:
        timeout.dispose()
    assert sizes[:4] == [200, 100, 50, 25] and pruner.batch == 25
    assert pruner.rounds == 1
    assert_pruned(store)


def test_any_other_error_ends_the_round_without_raising(
        resilient: Resilient, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(retention, "delete_ledger_markers", broken)
    pruner = Pruner(resilient)
    with caplog.at_level(logging.ERROR):
        for _ in range(50):  # (the first turn may spend its time on the first tables)
            pruner.turn()
            if not pruner.busy:
                break
    assert not pruner.busy and pruner.rounds == 1
    assert any(getattr(r, "action", None) == "prune_error" for r in caplog.records)


def test_nothing_is_pruned_when_every_retention_is_off(store_url: str,
                                                       table_prefix: str) -> None:
    app = Celery("ret-off", set_as_current=False)
    app.conf.update(resilient_store_url=store_url, resilient_table_prefix=table_prefix,
                    resilient_auto_migrate=True, resilient_work_retention=None,
                    resilient_ledger_retention=None, resilient_worker_row_retention=None,
                    resilient_beat_run_retention=1)
    rt = Resilient(app)
    try:
        fill(rt.store)
        Pruner(rt).turn()
        assert count(rt.store, "work") == 12
        assert count(rt.store, "ledger") == 7
        assert count(rt.store, "workers") == 2
    finally:
        rt.store.dispose()


class _Gate:
    """Records what the maintainer tells the consumption gate (a real gate needs a worker)."""

    def __init__(self) -> None:
        self.downs: list[str] = []

    def store_down(self, why: str) -> None:
        self.downs.append(why)

    def store_up(self) -> None:
        return None


def test_a_real_maintainer_prunes_and_survives_a_store_outage(
        resilient: Resilient, pruned: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The pruning thread beside the maintainer prunes on its own; a failed prune turn is
    retried after a backoff and never pauses consumption nor counts as the maintainer's
    outage (its receipts and sweeps went on meanwhile)."""
    store = resilient.store
    fill(store)
    real = retention.delete_finished_work
    failures: list[int] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if len(failures) < 2:
            failures.append(1)
            raise StoreUnavailable("store unreachable during delete_finished_work (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(retention, "delete_finished_work", flaky)
    gate = _Gate()
    maint = Maintainer(resilient, Owner("ret@host", "inc-ret", os.getpid()),
                       gate=gate)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="celery_resilient.worker"):  # maintainer, pruner
        maint.start()
        try:
            wait_for(lambda: len(failures) == 2, 10, "two failed prune turns")
            wait_for(lambda: maint.pruner.rounds >= 1 and not maint.pruner.busy, 30,
                     "a completed prune round after the outage")
            assert maint.is_alive() and maint.pruning.is_alive()
        finally:
            maint.stop()
            maint.join(10)
    assert not maint.is_alive() and not maint.pruning.is_alive()
    assert_pruned(store)
    assert gate.downs == [] and maint.last_failure is None
    assert ("work", 4) in pruned
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("prune_retry") == 2
    line = next(r for r in caplog.records if getattr(r, "action", None) == "pruned")
    assert line.tables["work"] == 10  # type: ignore[attr-defined]
