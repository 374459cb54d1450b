"""The bad-input catalogue: each case gets a clear error naming the problem, and loses nothing.

Cases and where they are proven (no case is tested twice):

====  ==========================================================  =================================
  #   case                                                        test
====  ==========================================================  =================================
  1   unserialisable checkpoint state (object, set)               test_bad_input.py
  2   oversized checkpoint state                                  test_bad_input.py
  3   corrupted checkpoint row (edited to invalid JSON)           here
  4   corrupted step / ledger result rows                         here
  5   store unreachable at worker startup (real worker)           e2e/test_poison.py
  6   store unreachable mid-operation (every store operation)     test_bad_input.py
      ... and mid-task under a real worker (cluster stopped)      e2e/test_store_outage.py
  7   schema missing                                              here
  8   schema behind / at an unknown revision                      here
  9   poison message crash loop (kills its own pool child)        e2e/test_poison.py
 10   clock skew between worker and database                      here
 11   same work key sent with different arguments                 here
 12   invalid settings (every key, typos, unsupported dialect)    unit/test_config.py, here
 13   empty / blank / too-long / non-string ledger key            test_bad_input.py
 14   context write with a stale version                          test_context_store.py
 15   beat entry with an invalid schedule or catch-up option      here, e2e/test_poison.py
 16   invalid step names, unserialisable step / ledger results    test_bad_input.py
 17   a claim whose pool process died is not kept alive           here
 18   malformed kill-point spec (RESILIENT_KILL_AT)               here
 19   checkpoint outside a running task                           here
 20   a task name or id longer than the store keeps (255)         test_bad_input.py
 21   a value over MySQL's max_allowed_packet                     test_packet_limit.py,
                                                                  e2e/test_packet_limit.py
====  ==========================================================  =================================
"""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from celery.schedules import schedule
from sqlalchemy import inspect, text, update

from celery_resilient import Resilient, ResumableTask
from celery_resilient.beat import windows
from celery_resilient.beat.policy import CatchupPolicy
from celery_resilient.core import codec, killpoints
from celery_resilient.core.identity import pid_alive
from celery_resilient.errors import (
    ConfigurationError,
    ResilientError,
    ScheduleError,
    SchemaError,
    SerializationError,
    WorkKeyConflict,
)
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store import migrate
from celery_resilient.store.sql import Store
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.ledger import Ledger
from celery_resilient.tasks.steps import run_step

from .helpers import execution, owner, run, take


def _corrupt(store: Store, table: Any, column: str, **where: Any) -> None:
    with store.begin() as conn:
        stmt = update(table).values({column: '{"row": 3,'})  # truncated: invalid JSON
        for name, value in where.items():
            stmt = stmt.where(table.c[name] == value)
        assert conn.execute(stmt).rowcount == 1


# -- 3, 4: corrupted rows -------------------------------------------------------------------


def test_corrupted_checkpoint_row_is_a_clear_error_and_is_not_overwritten(store: Store) -> None:
    x = execution(store, run(store, "k", owner()))
    Checkpoint(x).save({"row": 2})
    _corrupt(store, store.t.work, "checkpoint_json", work_key="k")
    with pytest.raises(SerializationError) as info:
        Checkpoint(x).load(default={"row": 0})
    message = str(info.value)
    assert "checkpoint #1 of work 'k'" in message and "not valid JSON" in message
    assert store.load_checkpoint("k") == ('{"row": 3,', 1)  # the evidence is kept as it was
    assert store.get_work("k").state == "running"  # type: ignore[union-attr]


def test_corrupted_step_and_ledger_rows_name_the_row_and_rerun_nothing(store: Store) -> None:
    x = execution(store, run(store, "k", owner()))
    calls: list[str] = []
    run_step(x, "send", calls.append, "step")
    Ledger(store, x).once("pay:1", calls.append, "ledger")
    _corrupt(store, store.t.steps, "result_json", work_key="k", name="send")
    _corrupt(store, store.t.ledger, "result_json", key="pay:1")
    with pytest.raises(SerializationError, match="result of step 'send' of work 'k'"):
        run_step(x, "send", calls.append, "step")
    with pytest.raises(SerializationError, match="ledger key 'pay:1'"):
        Ledger(store, x).once("pay:1", calls.append, "ledger")
    assert calls == ["step", "ledger"]  # a corrupted marker never re-runs the effect


# -- 7, 8: schema ---------------------------------------------------------------------------


@pytest.mark.parametrize("store_url", ["sqlite", "postgresql"], indirect=True)
def test_missing_schema_is_a_clear_error_and_creates_nothing(store_url: str,
                                                             table_prefix: str) -> None:
    fresh = Store(store_url, table_prefix)
    try:
        with pytest.raises(SchemaError) as info:
            fresh.ensure_schema(migrate_if_needed=False)
        message = str(info.value)
        assert f"tables {table_prefix}*" in message and "missing" in message
        assert "resilient migrate" in message  # says what to do
        names = inspect(fresh.engine).get_table_names()
        assert not [n for n in names if n.startswith(table_prefix)]
    finally:
        fresh.dispose()


def test_schema_at_another_revision_is_refused_and_left_alone(store: Store) -> None:
    version_table = f"{store.prefix}alembic_version"
    with store.begin() as conn:
        conn.execute(text(f"UPDATE {version_table} SET version_num = 'f00dbeef'"))
    run(store, "kept", owner())
    with pytest.raises(SchemaError) as info:
        store.ensure_schema(migrate_if_needed=False)
    assert "at revision f00dbeef, expected " + migrate.head_revision() in str(info.value)
    assert migrate.current_revision(store.engine, store.prefix) == "f00dbeef"
    assert store.get_work("kept") is not None  # no data touched


# -- 10: clock skew -------------------------------------------------------------------------


def test_leases_use_the_database_clock_not_the_workers(store: Store,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose clock is an hour fast (or slow) computes no lease from it.

    Shown without faketime: this process's ``time.time`` is moved an hour ahead (what a
    skewed worker host would read); every lease written and every expiry judged must still
    follow the database's ``clock_timestamp()`` / ``julianday('now')``.
    """
    real = time.time
    for skew in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda skew=skew: real() + skew)
        key = f"skew{int(skew)}"
        run(store, key, owner("skewed@host"))
        db_now = store.now()
        lease = store.get_work(key).lease_expires_at  # type: ignore[union-attr]
        assert lease is not None and abs(lease - (db_now + 30)) < 5, (skew, lease, db_now)
        assert abs(db_now - real()) < 5  # the DB clock, not the skewed one
        # the lease is not judged expired (fast clock) nor immortal (slow clock)
        assert store.claim_orphans(owner("sweeper@host"), 10, 30) == []
    monkeypatch.setattr(time, "time", real)


# -- 11: same work key, different arguments ---------------------------------------------------


@pytest.mark.parametrize("first_state", ["reserved", "running", "done"])
def test_same_work_key_with_different_arguments_is_refused(store: Store,
                                                           first_state: str) -> None:
    a, b = codec.digest([[1], {}]), codec.digest([[2], {}])
    me = owner()
    if first_state == "reserved":
        store.record_receipt("inv:1", "proj.task", "t1", a, '{"m": 1}', me, 30)
    else:
        claim = run(store, "inv:1", me, task_id="t1", digest=a)
        x = execution(store, claim)
        Checkpoint(x).save({"row": 5})
        if first_state == "done":
            store.finish("inv:1", claim.epoch, '"first"')
    before = store.get_work("inv:1")
    with pytest.raises(WorkKeyConflict) as info:
        take(store, "inv:1", owner("other@host"), task_id="t2", digest=b)
    assert "'inv:1'" in str(info.value) and "t1" in str(info.value)
    assert "different arguments" in str(info.value)
    after = store.get_work("inv:1")
    assert after is not None and before is not None
    assert (after.state, after.epoch, after.task_id, after.owner_node, after.result_json) == (
        before.state, before.epoch, before.task_id, before.owner_node, before.result_json)
    if first_state != "reserved":
        assert codec.decode(store.load_checkpoint("inv:1")[0]) == {"row": 5}  # type: ignore[index]


# -- 12: settings (cases test_config.py does not cover) -----------------------------------------


@pytest.mark.parametrize(("settings", "named"), [
    ({"resilient_lease_second": 30}, "resilient_lease_second"),  # a typo
    ({"resilient_lease_seconds": "soon"}, "resilient_lease_seconds"),
    ({"resilient_store_url": "mongodb://127.0.0.1/x"}, "resilient_store_url"),
    ({"resilient_store_url": "postgresql+nosuchdriver://127.0.0.1/x"}, "nosuchdriver"),
])
def test_invalid_settings_fail_at_startup_naming_the_key(settings: dict[str, Any],
                                                        named: str) -> None:
    app = Celery("bad", broker="memory://", set_as_current=False)
    app.conf.update(settings)
    rt = Resilient(app)
    with pytest.raises((ConfigurationError, ResilientError)) as info:
        ResilientConfig.from_mapping(app.conf)
        _ = rt.store  # the store URL's driver is only known when it is loaded
    assert named in str(info.value)


def test_resilient_applied_twice_is_refused() -> None:
    app = Celery("twice", broker="memory://", set_as_current=False)
    Resilient(app)
    with pytest.raises(ConfigurationError, match="already applied"):
        Resilient(app)


# -- 15: beat entries -----------------------------------------------------------------------


@pytest.mark.parametrize(("options", "named"), [
    ({"resilient_catchup": "sometimes"}, "resilient_catchup='sometimes'"),
    ({"resilient_catchup_max_slots": 0}, "resilient_catchup_max_slots=0"),
    ({"resilient_catchup_grace": float("nan")}, "resilient_catchup_grace=nan"),
    ({"resilient_catchup_deadline": -1}, "resilient_catchup_deadline=-1"),
    ({"resilient_catchup_typo": 1}, "resilient_catchup_typo"),
])
def test_invalid_beat_catchup_option_names_entry_and_option(options: dict[str, Any],
                                                            named: str) -> None:
    with pytest.raises(ScheduleError) as info:
        CatchupPolicy().for_options(options, "nightly-report")
    assert "'nightly-report'" in str(info.value) and named in str(info.value)


@pytest.mark.parametrize("every", [0, -5])
def test_non_positive_interval_schedule_is_refused(every: int) -> None:
    bad = schedule(timedelta(seconds=every))
    with pytest.raises(ValueError, match="must have a positive run_every"):
        windows.slots_between(bad, 0, 10_000_000, 10)
    with pytest.raises(ValueError, match="must have a positive run_every"):
        windows.next_slot(bad, 0)


# -- 17: a pool process that died must not keep its claim ---------------------------------------


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_a_claim_whose_pool_process_died_is_released(store: Store) -> None:
    """Found by the chaos soak: a SIGKILLed pool child's claim was renewed by the live main
    process forever; the copy Celery requeued went to another worker, was skipped as "held",
    and the work never finished. Now the worker releases it at its next round and the sweeper
    of any worker re-publishes it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)
    main = owner("a@host")
    store.register(main, "", 30)
    dead_child = owner("a@host", incarnation=main.incarnation, pid=child.pid)
    run(store, "orphaned", dead_child)
    run(store, "alive", main)  # a live pool process of the same worker keeps its claim
    assert store.reconcile(main, pid_alive) == 1
    orphans = store.claim_orphans(owner("b@host"), 10, 30)
    assert [o.work_key for o in orphans] == ["orphaned"]
    row = store.get_work("orphaned")
    assert row is not None and row.state == "requeued" and row.deaths == 1
    assert store.get_work("alive").state == "running"  # type: ignore[union-attr]


# -- 18, 19 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "named"), [
    ("after_chekpoint", "'after_chekpoint'"), ("after_step:zero", "after_step:zero"),
    ("before_ack:0", "before_ack:0")])
def test_malformed_kill_point_spec_is_refused(spec: str, named: str) -> None:
    with pytest.raises(ValueError, match="RESILIENT_KILL_AT") as info:
        killpoints.parse(spec)
    assert named in str(info.value)
    assert killpoints.parse("after_step:2, before_ack") == {"after_step": 2, "before_ack": 1}


def test_checkpoint_outside_a_running_task_is_a_clear_error() -> None:
    """A direct call ``job()`` runs as in Celery (in-memory progress); ``job.run()``
    bypasses ``__call__``, so there is no execution at all: a clear error says so."""
    app = Celery("direct", broker="memory://", set_as_current=False)
    Resilient(app)

    @app.task(base=ResumableTask, bind=True, shared=False)
    def job(self: ResumableTask) -> Any:
        return self.checkpoint.load(default="fresh")

    assert job() == "fresh"
    with pytest.raises(ResilientError, match=r"task.run\(...\) bypasses them"):
        job.run()

