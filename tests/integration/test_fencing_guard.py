"""The fencing guard's harder judgements, on a real
PostgreSQL: a liveness session on another database is refused (it would let every probe
prove a live worker dead), a renewal that comes only after the lease may have run out
fences what ran across the gap, and a pool without child processes fences by exiting."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_resilient import Resilient
from celery_resilient.core import liveness
from celery_resilient.store.sql import UNJUDGED, Store
from celery_resilient.testing import wait_for
from celery_resilient.worker.fencing import EX_FENCED, Fence, FencingGuard
from celery_resilient.worker.lease import LeaseKeeper

from .helpers import owner


@pytest.fixture
def store(pg_store: Store) -> Store:
    return pg_store


@pytest.fixture
def other_database(pg_url: str, table_prefix: str) -> Iterator[str]:
    """A second database on the store's server."""
    name = f"{table_prefix}other".lower()
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _runtime(store: Store, **settings: object) -> Resilient:
    app = Celery(f"guard-{os.getpid()}-{time.monotonic_ns()}", set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix,
                    **{f"resilient_{k}": v for k, v in settings.items()})
    return Resilient(app)


def _liveness_server(store: Store, incarnation: str) -> object:
    wk = store.t.workers
    with store.engine.connect() as conn:
        value = conn.execute(wk.select().with_only_columns(wk.c.liveness_server)
                             .where(wk.c.incarnation == incarnation)).scalar_one()
        conn.rollback()
    return value


def test_a_liveness_url_on_another_database_is_refused(
        store: Store, other_database: str, caplog: pytest.LogCaptureFixture) -> None:
    """Advisory locks are per database: a lock held on another database is one the store's
    probes can always take. The guard gives the session proof up at start (the review saw a
    live worker proven dead and its work run beside it for 59 s)."""
    rt = _runtime(store, liveness_url=other_database)
    me = owner("wrongdb@host")
    store.register(me, liveness.current(), 30)
    guard = FencingGuard(rt, me, LeaseKeeper(rt, me))
    with caplog.at_level(logging.ERROR, logger="celery_resilient.worker.fencing"):
        guard.open_session()
    try:
        assert "reaches another database or server than the store" in caplog.text
        assert guard.describe().startswith("lease (resilient_liveness_url does not reach")
        assert _liveness_server(store, me.incarnation) is None, "no lock recorded to probe"
        assert store.prove_dead(me.incarnation) == UNJUDGED
    finally:
        guard.close()
        guard.keeper.store.dispose()


def test_a_liveness_url_on_the_stores_database_is_kept(store: Store) -> None:
    rt = _runtime(store, liveness_url=store.url)
    me = owner("rightdb@host")
    store.register(me, liveness.current(), 30)
    guard = FencingGuard(rt, me, LeaseKeeper(rt, me))
    guard.open_session()
    try:
        assert guard.describe() == "session"
        assert _liveness_server(store, me.incarnation) is not None
    finally:
        guard.close()
        guard.keeper.store.dispose()


def test_a_renewal_after_the_fence_deadline_fences_once(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """A process frozen past the lease wakes and renews before the guard looks: the renewal
    must not hide the gap (the review's zombie ran 33 s after waking)."""
    rt = _runtime(store, lease_seconds=6, heartbeat_interval=1, session_liveness=False)
    me = owner("frozen@host")
    store.register(me, liveness.current(), 6)
    keeper = LeaseKeeper(rt, me)
    fence = Fence()
    guard = FencingGuard(rt, me, keeper, fence)
    keeper.renewal_sent_at = time.monotonic() - (rt.config.fence_after + 5)  # frozen this long
    keeper.start()
    try:
        wait_for(lambda: keeper.renewals >= 1, 10, "a renewal after the gap")
        assert keeper.lapsed is not None and keeper.lapsed > rt.config.fence_after
        with caplog.at_level(logging.WARNING, logger="celery_resilient.worker.fencing"):
            guard.tick()
        assert "SELF-FENCING (lease)" in caplog.text and "without a renewal" in caplog.text
        assert "fence lifted" in caplog.text, "renewed again: the fence lifts"
        assert not fence.engaged and keeper.lapsed is None
        caplog.clear()
        guard.tick()
        assert "SELF-FENCING" not in caplog.text, "one gap fences once"
    finally:
        keeper.stop()
        keeper.join(5)


IN_PROCESS = """
from celery.worker import state
from celery_resilient.tasks.task import ResumableTask
from celery_resilient.worker.fencing import Fence
import os

class Request:  # what Celery's solo and threads pools leave in active_requests
    name, id, worker_pid, task = "t", "id-1", os.getpid(), ResumableTask()

running = Request()
state.active_requests.add(running)
Fence().stop_executions()
print("still running", flush=True)
"""


def test_a_pool_without_child_processes_fences_by_exiting() -> None:
    """solo and threads run the task in the worker's own process: there is no pool process
    to kill, so the fence ends the worker (the review saw 73 s of overlap on both)."""
    done = subprocess.run([sys.executable, "-c", IN_PROCESS], capture_output=True, text=True,
                          check=False,
                          timeout=60)
    assert done.returncode == EX_FENCED, done.stderr
    assert "still running" not in done.stdout
    assert "runs in the worker's own process" in done.stderr
