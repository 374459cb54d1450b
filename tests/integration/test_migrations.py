"""Alembic migrations create exactly the schema module's tables, on both dialects."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from celery import Celery
from sqlalchemy import create_engine, inspect, select, text

from celery_resilient import Resilient
from celery_resilient.errors import SchemaError
from celery_resilient.store import migrate
from celery_resilient.store.operator_queries import OperatorQueries, Selection
from celery_resilient.store.retention import delete_finished_work
from celery_resilient.store.schema import WORK_FILLFACTOR, build_tables
from celery_resilient.store.sql import Receipt, Store
from celery_resilient.testing import wait_for
from celery_resilient.testing.services import ThrowawayPostgres

from .helpers import expire, owner, run, started

TABLES = ("work", "checkpoints", "steps", "ledger", "schedule_runs", "schedule_markers",
          "contexts", "workers", "revocations", "forgotten")


def _ours(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        names = {n for n in inspect(conn).get_table_names() if n.startswith(store.prefix)}
        conn.rollback()
    return names


def _diff(store: Store) -> list[Any]:
    prefix = store.prefix

    def include_name(name: str | None, type_: str, parent: Any) -> bool:
        return type_ != "table" or bool(name and name.startswith(prefix))

    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={
            "version_table": f"{prefix}alembic_version",
            "include_name": include_name,
            "compare_type": True,
            "compare_server_default": True,
        })
        diff = compare_metadata(ctx, build_tables(prefix).metadata)
        conn.rollback()
    return list(diff)


@pytest.fixture
def bare_store(store_url: str, table_prefix: str) -> Any:
    s = Store(store_url, table_prefix)
    yield s
    s.dispose()


def test_upgrade_from_empty_creates_exactly_the_schema(bare_store: Store) -> None:
    assert _ours(bare_store) == set()
    bare_store.migrate()
    prefix = bare_store.prefix
    assert _ours(bare_store) == {f"{prefix}{t}" for t in TABLES} | {f"{prefix}alembic_version"}
    assert _diff(bare_store) == []
    assert migrate.current_revision(bare_store.engine, prefix) == migrate.head_revision()


def test_upgrade_is_idempotent(bare_store: Store) -> None:
    bare_store.migrate()
    bare_store.migrate()
    assert _diff(bare_store) == []


def test_downgrade_to_base_removes_every_table(bare_store: Store) -> None:
    bare_store.migrate()
    migrate.downgrade(bare_store.engine, bare_store.prefix, "base")
    assert _ours(bare_store) <= {f"{bare_store.prefix}alembic_version"}
    assert migrate.current_revision(bare_store.engine, bare_store.prefix) is None
    bare_store.migrate()  # and back up again
    assert _diff(bare_store) == []


def test_missing_schema_names_the_fix_when_auto_migrate_is_off(bare_store: Store) -> None:
    with pytest.raises(SchemaError) as info:
        bare_store.ensure_schema(migrate_if_needed=False)
    message = str(info.value)
    assert "missing" in message
    assert migrate.FIX_COMMAND in message
    assert f"{bare_store.prefix}*" in message
    assert _ours(bare_store) == set()  # nothing was created behind the user's back


def test_postgresql_store_does_not_migrate_itself_by_default(pg_url: str,
                                                             table_prefix: str) -> None:
    app = Celery("mig-pg", broker="memory://", set_as_current=False)
    app.conf.resilient_store_url = pg_url
    app.conf.resilient_table_prefix = table_prefix
    rt = Resilient(app)
    with pytest.raises(SchemaError, match="resilient migrate"):
        _ = rt.store
    rt._store.dispose()  # type: ignore[union-attr]


def test_sqlite_store_migrates_itself_by_default(tmp_path: Any) -> None:
    app = Celery("mig-sqlite", broker="memory://", set_as_current=False)
    app.conf.resilient_store_url = f"sqlite:///{tmp_path}/self.sqlite3"
    store = Resilient(app).store
    try:
        assert _diff(store) == []
        assert migrate.current_revision(store.engine, store.prefix) == migrate.head_revision()
    finally:
        store.dispose()


def test_sqlite_store_with_auto_migrate_off_fails_clearly(tmp_path: Any) -> None:
    app = Celery("mig-sqlite-off", broker="memory://", set_as_current=False)
    app.conf.resilient_store_url = f"sqlite:///{tmp_path}/off.sqlite3"
    app.conf.resilient_auto_migrate = False
    rt = Resilient(app)
    with pytest.raises(SchemaError, match="resilient_auto_migrate"):
        _ = rt.store
    rt._store.dispose()  # type: ignore[union-attr]


def test_outdated_schema_names_both_revisions(bare_store: Store) -> None:
    bare_store.migrate()
    with bare_store.engine.begin() as conn:
        conn.execute(text(f"UPDATE {bare_store.prefix}alembic_version SET version_num = '0000'"))
    with pytest.raises(SchemaError) as info:
        bare_store.ensure_schema(migrate_if_needed=False)
    message = str(info.value)
    assert f"at revision 0000, expected {migrate.head_revision()}" in message
    assert migrate.FIX_COMMAND in message


def test_0005_moves_each_checkpoint_into_its_work_row_and_back(bare_store: Store) -> None:
    """A store upgraded with checkpoints in it keeps every one (state, seq, epoch, time), in
    the work row; the old table stays as it was (for workers of the previous version during
    a rolling deploy), and a downgrade writes the work rows' checkpoints back into it."""
    p, engine = bare_store.prefix, bare_store.engine
    migrate.upgrade(engine, p, "0004")
    with engine.begin() as conn:
        for key, state in (("a", "running"), ("b", "done"), ("c", "reserved")):
            conn.execute(text(
                f"INSERT INTO {p}work (work_key, task_name, task_id, state, epoch, attempts, "
                f"deaths, republished, retries, created_at, updated_at) VALUES "
                f"(:k, 't', :k, :s, 3, 1, 0, 0, 0, 1.0, 2.0)"), {"k": key, "s": state})
        for key, seq in (("a", 4), ("b", 9), ("orphan", 1)):
            conn.execute(text(f"INSERT INTO {p}checkpoints VALUES (:k, 2, :seq, :j, 5.5)"),
                         {"k": key, "seq": seq, "j": f'{{"at": "{key}"}}'})
    bare_store.migrate()
    assert _diff(bare_store) == []
    with engine.connect() as conn:  # the old table is left as it was, unread
        assert conn.execute(text(f"SELECT count(*) FROM {p}checkpoints")).scalar_one() == 3
        conn.rollback()
    assert bare_store.load_checkpoint("a") == ('{"at": "a"}', 4)
    assert bare_store.load_checkpoint("b") == ('{"at": "b"}', 9)
    assert bare_store.load_checkpoint("c") is None
    with engine.connect() as conn:
        row = conn.execute(text(f"SELECT checkpoint_epoch, checkpoint_at, checkpoint_seq "
                                f"FROM {p}work WHERE work_key = 'a'")).one()
        none = conn.execute(text(f"SELECT checkpoint_seq FROM {p}work WHERE work_key = 'c'"))
        assert (tuple(row), none.scalar_one()) == ((2, 5.5, 4), 0)
        conn.rollback()

    migrate.downgrade(engine, p, "0004")
    with engine.connect() as conn:
        back = conn.execute(text(f"SELECT work_key, epoch, seq, state_json, updated_at "
                                 f"FROM {p}checkpoints ORDER BY work_key")).all()
        conn.rollback()
    assert [tuple(r) for r in back] == [("a", 2, 4, '{"at": "a"}', 5.5),
                                        ("b", 2, 9, '{"at": "b"}', 5.5)]  # the orphan went
    bare_store.migrate()
    assert bare_store.load_checkpoint("b") == ('{"at": "b"}', 9)


def test_workers_migrating_at_once_all_start(store_url: str, table_prefix: str) -> None:
    """Several workers started together with ``resilient_auto_migrate`` on a fresh store all
    migrate it: one does the work, the others find it done (without the lock, half of them
    exited on a duplicate key of the version table)."""
    stores = [Store(store_url, table_prefix) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    errors: list[BaseException] = []

    def start(store: Store) -> None:
        barrier.wait()
        try:
            store.ensure_schema(migrate_if_needed=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in stores]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert _diff(stores[0]) == []
        assert migrate.current_revision(stores[0].engine, table_prefix) == migrate.head_revision()
    finally:
        for s in stores:
            s.dispose()


def test_what_this_version_clears_is_gone_from_the_old_checkpoint_table(store: Store) -> None:
    """During a rolling deploy a worker of the previous version reads ``<prefix>checkpoints``.
    A checkpoint this version clears (``checkpoint.clear``, a retry's hand-back), forgets or
    prunes must be gone from there too, or that worker resumes a fresh run past work it never
    did (a forgotten key re-submitted would run none of its rows)."""
    old = store.t.old_checkpoints

    def old_row(key: str) -> None:
        with store.begin() as conn:
            conn.execute(old.insert().values(work_key=key, epoch=1, seq=10,
                                             state_json='{"i": 10}', updated_at=1.0))

    def old_keys() -> set[str]:
        with store.engine.connect() as conn:
            keys = {str(k) for k in conn.execute(select(old.c.work_key)).scalars()}
            conn.rollback()
        return keys

    for key in ("cleared", "handed", "forgotten", "pruned", "kept"):
        old_row(key)
    cleared = run(store, "cleared", owner())
    store.clear_checkpoint("cleared", cleared.epoch)
    handed = run(store, "handed", owner())
    store.release("handed", handed.epoch, 60.0, clear_checkpoint=True)
    for key in ("forgotten", "pruned"):
        store.finish(key, run(store, key, owner()).epoch, "null")
    OperatorQueries(store).forget(Selection(keys=("forgotten",)))
    assert delete_finished_work(store, store.now() + 1).work == 1  # "pruned"
    assert old_keys() == {"kept"}


def test_a_take_brings_only_its_own_key_s_row_of_the_old_checkpoint_table(
        store: Store) -> None:
    """The take reads the checkpoint to resume from with the claim, the old table's row
    included (a rolling deploy from before 0005, or rows 0005 kept). Each path must bring the
    row of its own key only, exactly what ``load_checkpoint`` reads (found by the review: on
    SQLite the fast take's RETURNING matched every row of the old table)."""
    old = store.t.old_checkpoints
    with store.begin() as conn:
        for key in ("other", "own-fast", "own-careful"):
            conn.execute(old.insert().values(work_key=key, epoch=1, seq=7,
                                             state_json=f'{{"of": "{key}"}}', updated_at=1.0))
    who = owner()
    for key in ("fresh", "own-fast"):  # a receipt first: the one-statement take
        store.record_receipt(key, "proj.task", f"tid-{key}", None, None, who, 30.0)
    taken = {key: run(store, key, who) for key in ("fresh", "own-fast", "own-careful")}
    expire(store, "own-careful")
    taken["own-careful"] = run(store, "own-careful", owner("b@host"))  # the careful path
    for key, claim in taken.items():
        assert claim.resume is not None, key
        assert claim.resume.found == store.load_checkpoint(key), key
    assert taken["fresh"].resume is not None and taken["fresh"].resume.found is None
    assert store.load_checkpoint("own-fast") == ('{"of": "own-fast"}', 7)
    assert store.load_checkpoint("own-careful") == ('{"of": "own-careful"}', 7)


class _PreviousVersion:
    """What a worker of the pre-0005 version does to the store, statement for statement:
    its take moves the epoch and knows nothing of the work row's checkpoint columns; its
    checkpoints live in ``<prefix>checkpoints``."""

    def __init__(self, store: Store) -> None:
        self.store, self.w, self.old = store, store.t.work, store.t.old_checkpoints

    def take(self, key: str) -> int:
        w = self.w
        with self.store.begin() as conn:
            conn.execute(w.update().where(w.c.work_key == key).values(
                state="running", epoch=w.c.epoch + 1, attempts=w.c.attempts + 1))
            return int(conn.execute(select(w.c.epoch).where(w.c.work_key == key)).scalar_one())

    def save(self, key: str, epoch: int, state_json: str) -> None:
        with self.store.begin() as conn:
            conn.execute(self.old.delete().where(self.old.c.work_key == key))
            conn.execute(self.old.insert().values(work_key=key, epoch=epoch, seq=1,
                                                  state_json=state_json, updated_at=1.0))

    def hand_back(self, key: str, clear: bool = False) -> None:
        """Requeued; with ``clear``, as ``checkpoint.clear()`` or a ``self.replace``
        continuing the key."""
        with self.store.begin() as conn:
            if clear:
                conn.execute(self.old.delete().where(self.old.c.work_key == key))
            conn.execute(self.w.update().where(self.w.c.work_key == key).values(
                state="requeued"))


def test_a_checkpoint_the_previous_version_cleared_is_not_resumed(store: Store) -> None:
    """Rolling deploy across 0005: a checkpoint saved in the work row, then the work ran on a
    worker of the previous version, which cleared it (in the table it keeps) and handed the
    work on. The next execution here must start from zero; it resumed past the cleared
    checkpoint, skipping work, before migration 0006."""
    prev = _PreviousVersion(store)
    first = run(store, "k", owner())
    store.save_checkpoint("k", first.epoch, '{"i": 7}')
    store.release("k", first.epoch, 60.0)
    prev.take("k")
    prev.hand_back("k", clear=True)  # deletes nothing: its table never had this checkpoint
    run(store, "k", owner())
    assert store.load_checkpoint("k") is None


def test_across_versions_the_newest_checkpoint_or_an_earlier_one_is_resumed(
        store: Store) -> None:
    """Which checkpoint an execution resumes from when the two versions took turns: never one
    later than the last saved by either (that would skip work)."""
    prev = _PreviousVersion(store)
    old = store.t.old_checkpoints
    with store.begin() as conn:  # a checkpoint the previous version saved before the deploy
        conn.execute(old.insert().values(work_key="k", epoch=0, seq=3, state_json='{"i": 3}',
                                         updated_at=1.0))
    first = run(store, "k", owner())
    store.save_checkpoint("k", first.epoch, '{"i": 5}')
    store.release("k", first.epoch, 60.0)
    second = run(store, "k", owner())  # only this version since the save: the work row's
    assert store.load_checkpoint("k") == ('{"i": 5}', 1)
    store.release("k", second.epoch, 60.0)

    epoch = prev.take("k")  # the previous version resumes from its own (older) row, saves
    prev.save("k", epoch, '{"i": 8}')
    prev.hand_back("k")
    third = run(store, "k", owner())
    assert store.load_checkpoint("k") == ('{"i": 8}', 1)  # its save is the newest
    store.release("k", third.epoch, 60.0)

    fourth = run(store, "k", owner())  # still no save here since the other version's take
    assert store.load_checkpoint("k") == ('{"i": 8}', 1)
    store.save_checkpoint("k", fourth.epoch, '{"i": 9}')  # a save here: its own again
    store.release("k", fourth.epoch, 60.0)
    run(store, "k", owner())
    assert store.load_checkpoint("k") == ('{"i": 9}', 2)

    prev.take("k")
    prev.hand_back("k", clear=True)
    run(store, "k", owner())
    assert store.load_checkpoint("k") is None  # cleared there, taken here: from zero


def _work_row(conn: Any, prefix: str, state: str, epoch: int, **more: object) -> None:
    """Work ``k`` as any schema revision holds it, with ``more`` columns of later ones."""
    values: dict[str, object] = {
        "work_key": "k", "task_name": "t", "task_id": "k", "state": state, "epoch": epoch,
        "attempts": epoch, "deaths": 0, "republished": 0, "retries": 0, "created_at": 1.0,
        "updated_at": 2.0, **more}
    conn.execute(text(f"INSERT INTO {prefix}work ({', '.join(values)}) VALUES "
                      f"({', '.join(':' + c for c in values)})"), values)


def _running_under_the_previous_version(store: Store, to: str = "head") -> None:
    """At 0004: ``k`` running at epoch 1 on a worker of the previous version, which saved
    checkpoint #18 in its table; then the store is migrated to ``to`` under it."""
    p, engine = store.prefix, store.engine
    migrate.upgrade(engine, p, "0004")
    with engine.begin() as conn:
        _work_row(conn, p, "running", 1)
        conn.execute(text(f"INSERT INTO {p}checkpoints VALUES ('k', 1, 18, '{{\"i\": 18}}', 2.0)"))
    migrate.upgrade(engine, p, to)


@pytest.mark.parametrize("how", ["clear", "replace"])
def test_a_copied_checkpoint_the_old_worker_then_clears_is_not_resumed(
        bare_store: Store, how: str) -> None:
    """The store migrated under a running old worker, which
    then clears its checkpoint (and, for ``clear``, saves #1 of the fresh run) in its table
    within the same epoch. A new worker must resume that, or zero, never the copy."""
    prev = _PreviousVersion(bare_store)
    _running_under_the_previous_version(bare_store)
    if how == "clear":
        prev.hand_back("k", clear=True)
        prev.save("k", 1, '{"i": 7}')
    else:
        prev.hand_back("k", clear=True)
    run(bare_store, "k", owner())
    expected = ('{"i": 7}', 1) if how == "clear" else None
    assert bare_store.load_checkpoint("k") == expected


def test_a_copied_checkpoint_is_resumed_when_the_old_worker_left_it(bare_store: Store) -> None:
    """An ordinary upgrade: the copy is what the old table holds, so it is resumed as it is,
    and a save here makes the work row's checkpoint the one resumed from then on."""
    _running_under_the_previous_version(bare_store)
    with bare_store.begin() as conn:  # the old worker died; its claim lapsed
        conn.execute(text(f"UPDATE {bare_store.prefix}work SET state = 'requeued'"))
    claim = run(bare_store, "k", owner())
    assert bare_store.load_checkpoint("k") == ('{"i": 18}', 18)
    bare_store.save_checkpoint("k", claim.epoch, '{"i": 19}')
    bare_store.release("k", claim.epoch, 60.0)
    run(bare_store, "k", owner())
    assert bare_store.load_checkpoint("k") == ('{"i": 19}', 19)


def test_upgrading_from_0005_keeps_resuming_what_0005_saved(bare_store: Store) -> None:
    """A checkpoint a 0005 worker saved, whose work a 0005 worker took again before 0006 ran
    (the deploy killed it before its next save), is resumed after the upgrade, not redone."""
    p, engine = bare_store.prefix, bare_store.engine
    migrate.upgrade(engine, p, "0005")
    with engine.begin() as conn:
        _work_row(conn, p, "requeued", 3, checkpoint_json='{"i": 20}', checkpoint_seq=4,
                  checkpoint_epoch=1, checkpoint_at=2.0)
    bare_store.migrate()
    run(bare_store, "k", owner())
    assert bare_store.load_checkpoint("k") == ('{"i": 20}', 4)


def test_a_store_at_0005_whose_old_worker_saved_again_resumes_that_save(
        bare_store: Store) -> None:
    """The second review's case: migrated to 0005 under a running old worker, which then
    cleared and saved the fresh run's #1 in its table; 0006 runs with that worker still on
    the claim. The new worker must resume #1, not the copy (rows skipped before)."""
    p, engine = bare_store.prefix, bare_store.engine
    _running_under_the_previous_version(bare_store, to="0005")
    with engine.begin() as conn:  # the old worker's clear, then its first save
        conn.execute(text(f"DELETE FROM {p}checkpoints"))
        conn.execute(text(f"INSERT INTO {p}checkpoints VALUES ('k', 1, 1, '{{\"i\": 5}}', 3.0)"))
    bare_store.migrate()
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {p}work SET state = 'requeued'"))  # SIGKILLed; lapsed
    run(bare_store, "k", owner())
    assert bare_store.load_checkpoint("k") == ('{"i": 5}', 1)


def test_checkpoint_saves_rewrite_no_index_on_postgresql(throwaway_pg: ThrowawayPostgres,
                                                         table_prefix: str) -> None:
    """A save touches no indexed column; with room left on each page of the work table
    (its fillfactor), PostgreSQL keeps the new row version on its page and writes none of
    the table's five indexes (a HOT update). Units as a worker runs them, eight at a time:
    receipts, takes, five saves each, finishes. Counted by the server (takes and finishes
    change indexed columns: never HOT). On a server of its own: a transaction left open by
    any other session holds back the pruning of old row versions, and once a page's free
    space is used up saves stop being HOT."""
    pg_url = throwaway_pg.url
    store = Store(pg_url, table_prefix)
    store.migrate()
    engine = create_engine(pg_url, isolation_level="AUTOCOMMIT")

    def updates() -> tuple[int, int]:
        with engine.connect() as conn:
            row = conn.exec_driver_sql(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                f"WHERE relname = '{table_prefix}work'").one()
        return int(row[0]), int(row[1])

    try:
        with engine.connect() as conn:
            options = conn.exec_driver_sql(
                f"SELECT reloptions FROM pg_class WHERE relname = '{table_prefix}work'"
            ).scalar_one()
        assert options == [f"fillfactor={WORK_FILLFACTOR}"]
        me = started(store, owner())
        message = json.dumps({"body": "b" * 1200, "headers": {"id": "i" * 36}})
        units = 240
        before = updates()
        for first in range(0, units, 8):
            keys = [f"k{i}" for i in range(first, first + 8)]
            store.record_receipts([Receipt(k, "proj.task", f"tid-{k}", None, message)
                                   for k in keys], me, 30)
            claims = {k: run(store, k, me, task_id=f"tid-{k}") for k in keys}
            for n in range(5):
                for k in keys:
                    state = json.dumps({"row": n, "pad": "p" * 200})
                    assert store.save_checkpoint(k, claims[k].epoch, state) == n + 1
            for k in keys:
                store.finish(k, claims[k].epoch, '"ok"')
        # the server counts each backend's updates when it reports them (within a second)
        wait_for(lambda: updates()[0] - before[0] >= 7 * units, 15,
                 "the server to count every update")
        total, hot = (after - was for after, was in zip(updates(), before, strict=True))
        assert total == 7 * units
        assert hot >= 0.9 * 5 * units, f"{hot} HOT updates of {5 * units} saves"
    finally:
        store.dispose()
        engine.dispose()
