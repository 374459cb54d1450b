"""Proof of death by database session (celery_resilient.store.liveness): a real process
holds an incarnation's lock (PostgreSQL's advisory lock, MySQL's named lock) on a session of
its own; the proof follows its session. Each test runs on PostgreSQL and on MariaDB.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sqlalchemy import update

from celery_resilient.core import liveness
from celery_resilient.store import liveness as session_liveness
from celery_resilient.store.batched_takes import TakeRequest
from celery_resilient.store.sql import (
    ENDED_SUCCESSOR,
    PROVEN_DEAD,
    SESSION_ALIVE,
    UNJUDGED,
    Store,
)
from celery_resilient.testing.services import drop_prefixed_tables
from celery_resilient.testing.waiting import wait_for

from .helpers import owner, take

HOLDER = """
import sys, time
from celery_resilient.store.liveness import session_lock
lock = session_lock(sys.argv[1], sys.argv[2], sys.argv[3])
print(lock.acquire(), flush=True)
time.sleep(600)
"""


@pytest.fixture(params=["postgresql", "mariadb"])
def session_url(request: pytest.FixtureRequest, pg_url: str, mysql_url: str) -> str:
    return pg_url if request.param == "postgresql" else mysql_url


@pytest.fixture
def session_store(session_url: str, table_prefix: str) -> Iterator[Store]:
    """A migrated store of the test's own prefix, on each server with session locks."""
    s = Store(session_url, table_prefix)
    s.migrate()
    yield s
    s.dispose()
    if s.dialect.is_mysql:  # no schema per test there: its tables go
        drop_prefixed_tables(session_url, table_prefix)


def _hold(store: Store, incarnation: str) -> subprocess.Popen[str]:
    """A process holding ``incarnation``'s liveness lock; its row records the server."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, store.url, store.prefix,
                             incarnation], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    server = float(proc.stdout.readline())
    store.record_liveness(owner(incarnation=incarnation), server)
    return proc


def _kill(proc: subprocess.Popen[str], store: Store, incarnation: str) -> None:
    """SIGKILL the holder, and wait until its server has ended its session (a few ms: the
    lock is free once the server has read the socket's end)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()
    wait_for(lambda: not store.sees_liveness_lock(owner(incarnation=incarnation)), 5,
             "the server to end the killed holder's session", interval=0.002)


def test_a_dead_holders_session_is_proof_and_a_live_ones_is_not(session_store: Store) -> None:
    me, other = owner("w@a"), owner("w@b")
    for who in (me, other):
        session_store.register(who, liveness.current(), 30)
    holder = _hold(session_store, other.incarnation)
    try:
        assert session_store.prove_dead(other.incarnation) == SESSION_ALIVE
        assert session_store.lock_suspects(me, 0) == [other.incarnation]
    finally:
        _kill(holder, session_store, other.incarnation)
    # PostgreSQL frees the lock a few ms after the holder's process is gone
    assert session_store.prove_dead(other.incarnation) == PROVEN_DEAD
    wk = session_store.t.workers
    with session_store.engine.connect() as conn:
        ended = conn.execute(wk.select().where(wk.c.incarnation == other.incarnation)).one()
    # Found by another worker: its lease ends (resumable work is taken back), it is not
    # stopped (it may run on behind a partition), and sweeps probe it no more.
    assert ended.stopped_at is None and ended.lease_expires_at <= session_store.now()
    assert session_store.lock_suspects(me, 0) == []
    assert session_store.heartbeat(other, 30), "it renews its lease if it comes back"


def test_a_successor_of_the_node_ends_it_as_successor(session_store: Store) -> None:
    earlier, later = owner("pod@pod-0"), owner("pod@pod-0")
    session_store.register(earlier, liveness.current(), 30)
    session_store.register(later, liveness.current(), 30)
    _kill(_hold(session_store, earlier.incarnation), session_store, earlier.incarnation)
    assert session_store.prove_dead(earlier.incarnation, by=later) == PROVEN_DEAD
    gone = session_store.gone_incarnations([earlier.incarnation], later, 30)
    assert gone.dead == {earlier.incarnation}
    wk = session_store.t.workers
    with session_store.engine.connect() as conn:
        assert conn.execute(wk.select().where(wk.c.incarnation == earlier.incarnation)
                            ).one().ended_by == ENDED_SUCCESSOR


def test_a_session_proof_by_another_worker_takes_only_fenced_work(session_store: Store) -> None:
    """Found without a session by another worker's sweep, an incarnation may still run (a
    partition): unproven, only its resumable work goes back. A later start of its node name
    that finds the session still ended proves it dead: everything goes back."""
    gone_one, sweeper = owner("x@h1"), owner("y@h2")
    for who in (gone_one, sweeper):
        session_store.register(who, liveness.current(), 30)
    _kill(_hold(session_store, gone_one.incarnation), session_store, gone_one.incarnation)
    assert session_store.prove_dead(gone_one.incarnation) == PROVEN_DEAD
    gone = session_store.gone_incarnations([gone_one.incarnation], sweeper, 30)
    assert (gone.dead, gone.unproven) == (set(), {gone_one.incarnation})
    restart = owner("x@h1")
    session_store.register(restart, liveness.current(), 30)
    assert session_store.prove_dead(gone_one.incarnation, by=restart) == PROVEN_DEAD
    assert session_store.gone_incarnations([gone_one.incarnation], sweeper, 30).dead == {
        gone_one.incarnation}


def test_a_lock_taken_before_a_server_restart_proves_nothing(session_store: Store) -> None:
    """A restart or failover frees every lock: only a lock taken on this server start counts
    (here the recorded start is moved back, as a restart would leave it)."""
    me, other = owner(), owner()
    for who in (me, other):
        session_store.register(who, liveness.current(), 30)
    _kill(_hold(session_store, other.incarnation), session_store, other.incarnation)
    wk = session_store.t.workers
    with session_store.begin() as conn:
        conn.execute(update(wk).where(wk.c.incarnation == other.incarnation)
                     .values(liveness_server=wk.c.liveness_server - 3600))
    assert session_store.prove_dead(other.incarnation) == UNJUDGED
    assert session_store.lock_suspects(me, 0) == []


def test_sqlite_has_no_sessions_to_judge(tmp_path: object, table_prefix: str) -> None:
    store = Store(f"sqlite:///{tmp_path}/s.sqlite3", table_prefix)
    store.migrate()
    try:
        who = owner()
        store.register(who, liveness.current(), 30)
        assert store.prove_dead(who.incarnation) == UNJUDGED
        assert store.lock_suspects(owner(), 0) == []
    finally:
        store.dispose()


def test_the_holders_session_is_its_own_connection(session_url: str,
                                                   table_prefix: str) -> None:
    lock = session_liveness.session_lock(session_url, table_prefix, "inc-1")
    try:
        assert lock.acquire() is not None and lock.held
        other = session_liveness.session_lock(session_url, table_prefix, "inc-1")
        try:
            assert other.acquire() is None, "the same key cannot be held twice"
        finally:
            other.dispose()
        assert lock.ping() == lock.server
        lock.drop()
        assert not lock.held
        with pytest.raises(ConnectionError):
            lock.ping()
    finally:
        lock.dispose()


def test_a_take_held_by_a_worker_whose_session_ended_takes_over_at_once(
        session_store: Store) -> None:
    """A broker such as RabbitMQ redelivers a dead worker's messages at once, before any
    sweep judged it: the take that meets its claim (still within its lease) asks its
    session, and takes the work over when the session is gone; while it lives, it is held."""
    gone, me = owner("w@gone"), owner("w@here")
    for who in (gone, me):
        session_store.register(who, liveness.current(), 30)
    holder = _hold(session_store, gone.incarnation)
    session_store.take_batch([TakeRequest("k", "proj.task", "tid-k", 0, None, None, "{}")], [],
                        gone, 30.0, 5)  # taken by its main process, never started
    try:
        outcome = take(session_store, "k", me, task_id="tid-k")
        assert (outcome.action, outcome.held_by) == ("held", gone.incarnation)
    finally:
        _kill(holder, session_store, gone.incarnation)
    outcome = take(session_store, "k", me, task_id="tid-k")
    assert outcome.action == "run" and outcome.claim is not None
    assert (outcome.claim.epoch, outcome.claim.deaths) == (2, 0), "unstarted: no death"
