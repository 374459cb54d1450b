"""Revokes, expiry and time limits end work in the store, on SQLite and PostgreSQL.

The e2e proofs with real workers are in tests/e2e/test_outcomes.py; these pin the store's
half of each transition.
"""

from __future__ import annotations

from celery_resilient.runtime.outcomes import OutcomeBuffer
from celery_resilient.store.sql import Receipt, Store
from celery_resilient.worker.receiving import RevokeWatcher

from .helpers import always_live, expire, never_live, owner, run, take


def _receive(store: Store, key: str, task_id: str, who_node: str = "w@host") -> None:
    store.record_receipts([Receipt(key, "proj.task", task_id, None, '{"m": 1}')],
                          owner(who_node), 30)


def _state(store: Store, key: str) -> str | None:
    row = store.get_work(key)
    return None if row is None else row.state


def test_a_revoke_ends_unstarted_work_and_every_later_copy(store: Store) -> None:
    _receive(store, "k1", "t1")
    assert store.record_revocations(["t1", "t-unknown"]) == 1
    assert _state(store, "k1") == "revoked"
    # A copy of the same request (after a restart, another worker): never runs.
    assert take(store, "k1", owner("other@host"), task_id="t1").action == "stopped"
    # A request nobody received yet: the tombstone stops its first delivery too.
    late = take(store, "k2", owner("other@host"), task_id="t-unknown")
    assert late.action == "stopped" and late.reason == "revoked"
    assert _state(store, "k2") == "revoked"
    # Terminal: never re-published.
    expire(store, "k1")
    assert store.claim_orphans(owner("sweeper@host"), 10, 30) == []
    # A new request for the same work key is a new request: it runs, as in Celery.
    assert take(store, "k1", owner("w@host"), task_id="t1-new").action == "run"


def test_running_work_revoked_without_terminate_finishes_unless_its_owner_dies(
        store: Store) -> None:
    a = run(store, "ka", owner("a@host"), task_id="ta")
    b = run(store, "kb", owner("b@host"), task_id="tb")
    store.record_revocations(["ta", "tb"])
    assert _state(store, "ka") == _state(store, "kb") == "running"
    store.finish("ka", a.epoch, '"ok"')  # Celery lets a running task finish
    assert _state(store, "ka") == "done"
    # kb's owner dies: the sweep ends it revoked instead of re-publishing it.
    expire(store, "kb")
    assert store.claim_orphans(owner("sweeper@host"), 10, 30) == []
    assert _state(store, "kb") == "revoked"
    # A copy Celery requeued for the dead owner finds it revoked.
    assert take(store, "kb", owner("c@host"), task_id="tb", is_live=never_live).action == "stopped"
    assert b.epoch == 1


def test_a_copy_taking_over_dead_revoked_work_ends_it(store: Store) -> None:
    run(store, "kc", owner("a@host"), task_id="tc")
    store.record_revocations(["tc"])
    expire(store, "kc")
    out = take(store, "kc", owner("b@host"), task_id="tc", is_live=never_live)
    assert out.action == "stopped" and _state(store, "kc") == "revoked"


def test_end_request_records_main_process_outcomes_once(store: Store) -> None:
    run(store, "tl", owner("a@host"), task_id="t-tl")
    assert store.end_request("t-tl", "failed", "TimeLimitExceeded(3)") == 1
    assert store.end_request("t-tl", "failed", "TimeLimitExceeded(3)") == 0  # already ended
    row = store.get_work("tl")
    assert row is not None and row.state == "failed" and row.error == "TimeLimitExceeded(3)"
    expire(store, "tl")
    assert store.claim_orphans(owner("sweeper@host"), 10, 30) == []
    dup = take(store, "tl", owner("b@host"), task_id="t-tl", is_live=always_live)
    assert dup.action == "failed" and dup.reason == "TimeLimitExceeded(3)"
    _receive(store, "ex", "t-ex")
    store.end_request("t-ex", "expired", "its expires passed before it ran")
    assert take(store, "ex", owner("b@host"), task_id="t-ex").action == "stopped"


def test_an_expiry_relabels_the_revoke_celery_listed_for_it(store: Store) -> None:
    """Celery puts an expired id on its revoke list before announcing the expiry; whichever
    the worker records first, the work ends ``expired``. A real revoke stays revoked."""
    _receive(store, "e1", "t-e1")
    store.record_revocations(["t-e1"])
    assert _state(store, "e1") == "revoked"
    assert store.end_request("t-e1", "expired", "its expires passed before it ran") == 1
    assert _state(store, "e1") == "expired"
    run(store, "r1", owner("a@host"), task_id="t-r1")
    store.end_request("t-r1", "revoked", "revoked with terminate=True")
    assert store.end_request("t-r1", "expired", "late") == 0
    assert _state(store, "r1") == "revoked"


def test_cancelled_running_work_is_stopped_at_its_next_write(store: Store) -> None:
    from celery_resilient.errors import StaleClaimError, WorkStopped

    claim = run(store, "kx", owner("a@host"), task_id="tx")
    with store.begin() as conn:
        conn.execute(store.t.work.update().where(store.t.work.c.work_key == "kx")
                     .values(state="cancelled"))
    try:
        store.save_checkpoint("kx", claim.epoch, '{"row": 1}')
    except WorkStopped as exc:
        assert "cancelled" in str(exc)
    else:
        raise AssertionError("a cancelled execution's checkpoint was accepted")
    # An execution superseded by a takeover is fenced, not "stopped".
    run(store, "ky", owner("a@host"), task_id="ty")
    expire(store, "ky")
    newer = run(store, "ky", owner("b@host"), task_id="ty", is_live=never_live)
    try:
        store.save_checkpoint("ky", newer.epoch - 1, "{}")
    except WorkStopped:
        raise AssertionError("a superseded execution was reported as stopped") from None
    except StaleClaimError:
        pass


def test_revoke_watcher_copies_celery_revoke_list_once(store: Store) -> None:
    from celery.worker.state import revoked

    class Runtime:
        def __init__(self, s: Store) -> None:
            self.store = s

    rt = Runtime(store)
    _receive(store, "kw", "tw")
    watcher = RevokeWatcher()
    revoked.add("tw")
    try:
        assert watcher.flush(rt) >= 1  # type: ignore[arg-type]
        assert _state(store, "kw") == "revoked"
        assert watcher.flush(rt) == 0, "an id already recorded is not written again"  # type: ignore[arg-type]
    finally:
        revoked.discard("tw")


def test_outcome_buffer_keeps_outcomes_through_a_store_outage(store: Store) -> None:
    import threading

    from celery_resilient.errors import StoreUnavailable
    from celery_resilient.runtime.outcomes import Outcome

    unreachable = Store("postgresql+psycopg://postgres@127.0.0.1:1/test", store.prefix)
    buf = OutcomeBuffer(threading.Event())
    run(store, "ko", owner("a@host"), task_id="to")
    buf.add(Outcome("to", "failed", "TimeLimitExceeded(1)"))
    try:
        buf.flush(unreachable)
    except StoreUnavailable:
        pass
    else:
        raise AssertionError("an unreachable store did not raise StoreUnavailable")
    finally:
        unreachable.dispose()
    assert _state(store, "ko") == "running"
    assert buf.flush(store) == 1
    assert _state(store, "ko") == "failed"


def test_the_sweep_reports_work_it_ends_to_the_result_backend(store: Store,
                                                               redis_url: str) -> None:
    """Revoked work whose owner died ends in the store, and its caller must not wait on STARTED
    for ever (nobody else writes that request's result)."""
    from celery import Celery

    from celery_resilient import Resilient
    from celery_resilient.worker.recovery import sweep

    app = Celery("sweep-report", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix,
                    resilient_max_republish=1)
    rt = Resilient(app)
    try:
        run(store, "gone-revoked", owner("dead@host"), task_id="t-gone-revoked")
        store.record_revocations(["t-gone-revoked"])
        expire(store, "gone-revoked")
        store.record_submission("never", "proj.task", "t-never", None, '{"m": 1}', 10)
        with store.begin() as conn:  # already re-published once, never started
            conn.execute(store.t.work.update().where(store.t.work.c.work_key == "never")
                         .values(republished=1))
        expire(store, "never")
        assert sweep(rt, owner("sweeper@host")) == []
        revoked, dead = app.AsyncResult("t-gone-revoked"), app.AsyncResult("t-never")
        assert revoked.state == "REVOKED" and "owner died" in str(revoked.result)
        assert dead.state == "FAILURE" and type(dead.result).__name__ == "WorkDead"
        assert _state(store, "gone-revoked") == "revoked" and _state(store, "never") == "dead"
        revoked.forget()
        dead.forget()
    finally:
        app.close()
