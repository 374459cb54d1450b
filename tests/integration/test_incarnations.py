"""Worker incarnations: the lease keeper, proving predecessors dead, and the grace after an
outage. Real stores, real processes (a child process stands in for a dead predecessor)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid

import pytest
from celery import Celery

from celery_resilient import Resilient
from celery_resilient.core import liveness
from celery_resilient.core.identity import Owner
from celery_resilient.store.sql import Store
from celery_resilient.testing import wait_for
from celery_resilient.worker.lease import LeaseKeeper
from celery_resilient.worker.maintainer import Maintainer
from celery_resilient.worker.step import settle_predecessors

from .helpers import expire_incarnation, owner, run


def _runtime(store: Store, **settings: object) -> Resilient:
    app = Celery(f"inc-{os.getpid()}-{time.monotonic_ns()}", set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix,
                    **{f"resilient_{k}": v for k, v in settings.items()})
    return Resilient(app)


def _identity_of_an_exited_process() -> str:
    child = subprocess.Popen([sys.executable, "-c",
                              "from celery_resilient.core import liveness;"
                              "print(liveness.current(), flush=True)"],
                             stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=30)
    return out.strip()


def test_a_start_proves_a_dead_predecessor_and_warns_about_a_live_namesake(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    rt = _runtime(store)
    me = owner("same@host")
    dead = owner("same@host")
    store.register(dead, _identity_of_an_exited_process(), 30)
    alive = owner("same@host")
    store.register(alive, liveness.current(), 30)  # this very process: provably alive
    elsewhere = owner("same@host")
    store.register(elsewhere, "otherhost|boot|ns|1|1|tag", 30)  # cannot be judged from here
    store.register(me, liveness.current(), 30)
    with caplog.at_level(logging.INFO, logger="celery_resilient.worker.step"):
        settle_predecessors(rt, me)
    left = {r.incarnation for r in store.other_incarnations(me)}
    assert left == {alive.incarnation, elsewhere.incarnation}, "only the dead one is stopped"
    warnings = [r.getMessage() for r in caplog.records
                if "ANOTHER LIVE WORKER USES THE NODE NAME same@host" in r.getMessage()]
    assert len(warnings) == 1 and "its process runs on this host" in warnings[0], caplog.text
    # Another host, and no liveness session to probe: it says it cannot tell.
    unsure = [r.getMessage() for r in caplog.records if "CANNOT TELL WHETHER" in r.getMessage()]
    assert len(unsure) == 1 and elsewhere.incarnation in unsure[0], caplog.text
    # The dead predecessor's claims are orphans at once; the live namesakes' are not.
    run(store, "of-dead", dead)
    run(store, "of-alive", alive)
    run(store, "of-elsewhere", elsewhere)
    assert [o.work_key for o in store.claim_orphans(me, 10, 30)] == ["of-dead"]


def test_the_lease_keeper_renews_one_row_on_its_own_connection(store: Store) -> None:
    rt = _runtime(store, lease_seconds=4, heartbeat_interval=0.2)
    me = owner("keeper@host")
    store.register(me, liveness.current(), 4)
    keeper = LeaseKeeper(rt, me)
    assert keeper.store is not rt.store  # not behind the maintainer's or a task's pool
    keeper.start()
    try:
        wait_for(lambda: keeper.renewals >= 3, 10, "three renewals")
        wk = store.t.workers
        with store.engine.connect() as conn:
            lease, now = conn.execute(
                wk.select().with_only_columns(wk.c.lease_expires_at, store.dialect.now())
                .where(wk.c.incarnation == me.incarnation)).one()
            conn.rollback()
        assert lease > now + 3
        assert keeper.last_failure is None
    finally:
        keeper.stop()
        keeper.join(5)
    assert not keeper.is_alive()


def test_leases_are_not_judged_within_a_lease_of_an_outage(store: Store) -> None:
    rt = _runtime(store, lease_seconds=30)
    maint = Maintainer(rt, Owner("m@host", "inc", os.getpid()))
    assert maint.judge_leases()  # no failure seen, the server has been up for long
    maint.last_failure = time.monotonic()
    assert not maint.judge_leases()
    maint.last_failure = time.monotonic() - 31
    assert maint.judge_leases()
    if not store.dialect.is_sqlite:
        up_for = store.up_for()
        assert up_for is not None and up_for > 0


def test_a_sweeper_never_takes_its_own_incarnations_claims(store: Store) -> None:
    """Found by review: after a long SQLite write lock, a sweeper re-published its own live
    claims (its own lease had lapsed too). Its own claims it lets go itself (reconcile)."""
    me = owner("me@host")
    store.register(me, liveness.current(), 30)
    run(store, "mine", me)
    expire_incarnation(store, me)
    assert store.claim_orphans(me, 10, 30) == []
    assert [o.work_key for o in store.claim_orphans(owner("other@host"), 10, 30)] == ["mine"]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_renewal_held_up_by_a_write_lock_counts_as_an_outage(store: Store) -> None:
    """On SQLite a long transaction holds the database's write lock: renewals wait for it,
    and so did everyone else's. A late renewal gives other owners a lease of grace."""
    rt = _runtime(store, lease_seconds=2, heartbeat_interval=0.2)
    me = owner("late@host")
    store.register(me, liveness.current(), 2)
    keeper = LeaseKeeper(rt, me)
    keeper.start()
    try:
        wait_for(lambda: keeper.renewals >= 2, 10, "two renewals")
        assert keeper.last_failure is None
        with store.begin():  # BEGIN IMMEDIATE: the write lock, held for most of a lease
            held_since, renewals = time.monotonic(), keeper.renewals
            wait_for(lambda: time.monotonic() - held_since > 1.5, 10, "a lock held 1.5 s")
            assert keeper.renewals <= renewals + 1, "renewals went on under the write lock"
        wait_for(lambda: keeper.last_failure is not None, 10, "the late renewal noticed")
    finally:
        keeper.stop()
        keeper.join(5)
    maint = Maintainer(rt, Owner("m@host", "inc", os.getpid()), keeper)
    assert not maint.judge_leases()


def test_gone_incarnations_are_judged_as_the_sweep_judges_owners(store: Store) -> None:
    """Whose broker holding a sweep gives back, and how much: a stopped or proven-dead
    incarnation all of it; an expired lease only resumable work (and only while leases are
    judged); never the sweeper's own; unknown ones apart."""
    me, live, stopped, expired, dead = (owner() for _ in range(5))
    for who in (me, live, stopped, expired, dead):
        store.register(who, liveness.current(), 30)
    store.mark_stopped(stopped, 60)
    store.declare_dead(dead.incarnation)
    expire_incarnation(store, expired)
    unknown = uuid.uuid4().hex
    asked = [i.incarnation for i in (me, live, stopped, expired, dead)] + [unknown]
    gone = store.gone_incarnations(asked, me, 30)
    assert gone.dead == {stopped.incarnation, dead.incarnation}
    assert gone.unproven == {expired.incarnation}
    assert gone.unknown == {unknown}
    gone = store.gone_incarnations(asked, me, 30, judge_leases=False)
    assert gone.unproven == set(), "after an outage an expired lease proves nothing"
    assert store.gone_incarnations([me.incarnation], me, 30).dead == set()
