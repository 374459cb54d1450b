"""A broker outage during a sweep of 500 orphans: the lease is never late, the sweep gives up
in seconds, nothing counts as re-published until it is sent, and everything is sent once the
broker answers. Real PostgreSQL, a real redis-server of the test's own, killed and restarted."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_resilient import Resilient
from celery_resilient.core import liveness
from celery_resilient.core.identity import Owner
from celery_resilient.store.sql import Receipt, Store
from celery_resilient.testing import wait_for
from celery_resilient.testing.services import ThrowawayRedis
from celery_resilient.worker import recovery
from celery_resilient.worker.lease import LeaseKeeper

from .helpers import died, owner

ORPHANS = 500
QUEUE = "sweep-outage"


@pytest.fixture
def broker() -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis().start()
    try:
        yield server
    finally:
        server.destroy()


def _orphans(store: Store, n: int) -> None:
    dead = owner("gone@host")
    message = ('{"body": {"text": "[[], {}, {}]"}, "content_type": "application/json", '
               '"content_encoding": "utf-8", "headers": {"task": "proj.t", "id": "%s"}, '
               f'"properties": {{}}, "exchange": "", "routing_key": "{QUEUE}"}}')
    store.record_receipts([Receipt(f"k{i}", "proj.t", f"t{i}", None, message % f"t{i}")
                           for i in range(n)], dead, 30)
    died(store, dead)


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_broker_outage_during_a_sweep_of_500_orphans(store: Store,
                                                     broker: ThrowawayRedis) -> None:
    app = Celery("sweep-outage", broker=broker.url, set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix,
                    resilient_lease_seconds=2, resilient_heartbeat_interval=0.2,
                    resilient_sweep_batch=ORPHANS)
    rt = Resilient(app)
    _orphans(store, ORPHANS)
    me = Owner("sweeper@host", "sweeper-inc", os.getpid())
    store.register(me, liveness.current(), 2)
    keeper = LeaseKeeper(rt, me)
    keeper.start()
    renewals: list[float] = []
    watching = threading.Event()

    def watch() -> None:  # the lease row as other workers see it, every 50 ms
        wk = store.t.workers
        while not watching.is_set():
            with store.engine.connect() as conn:
                lease, now = conn.execute(
                    wk.select().with_only_columns(wk.c.lease_expires_at, store.dialect.now())
                    .where(wk.c.incarnation == me.incarnation)).one()
                conn.rollback()
            renewals.append(lease - now)
            watching.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        broker.kill()
        started = time.monotonic()
        assert recovery.sweep(rt, me) == []
        took = time.monotonic() - started
        assert took < 10, f"a sweep against a dead broker took {took:.1f}s"
        rows = store.list_work(limit=ORPHANS + 1)
        assert all(r.republished == 0 for r in rows), "unsent orphans counted as re-published"
        assert all(r.state == "reserved" for r in rows)

        broker.start()
        sent = wait_for(lambda: recovery.sweep(rt, me) or None, 30, "a sweep that sends")
        assert len(sent) == ORPHANS
        client = redis.Redis.from_url(broker.url)
        assert client.llen(QUEUE) == ORPHANS
        client.close()
        assert {r.republished for r in store.list_work(limit=ORPHANS + 1)} == {1}
        assert recovery.sweep(rt, me) == []  # each is held now: nothing sent twice
    finally:
        watching.set()
        watcher.join(5)
        keeper.stop()
        keeper.join(5)
    assert renewals and min(renewals) > 0, (
        f"the lease ran out during the broker outage (lowest remaining {min(renewals):.2f}s)")
    assert keeper.last_failure is None
