"""A store that stays connected and answers nothing (a paused pooler, a stalled proxy, a
frozen server), on a real PostgreSQL (and MariaDB: each test runs on both) behind a link of
the test's own that goes silent (``celery_resilient.testing.silent_link``): TCP stays up, so
no keepalive ever fires.

- A bounded store operation fails within its deadline as the store being unavailable, and
  the next one, once the link answers again, succeeds on a fresh connection.
- The fencing guard engages at the lease's fence deadline while the lease keeper's renewal
  and the liveness session's ping hang on the link; both recover by themselves afterwards
  and the fence lifts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest
from celery import Celery
from sqlalchemy.engine import make_url

from celery_resilient import Resilient
from celery_resilient.core import liveness
from celery_resilient.errors import StoreUnavailable
from celery_resilient.store import deadlines
from celery_resilient.store.sql import Store
from celery_resilient.testing import wait_for
from celery_resilient.testing.silent_link import SilentLink
from celery_resilient.worker.fencing import Fence, FencingGuard
from celery_resilient.worker.lease import LeaseKeeper

from .helpers import owner


@pytest.fixture(params=["postgresql", "mariadb"])
def server_url(request: pytest.FixtureRequest, pg_url: str, mysql_url: str) -> str:
    return pg_url if request.param == "postgresql" else mysql_url


@pytest.fixture
def link(server_url: str) -> Iterator[SilentLink]:
    url = make_url(server_url)
    silent = SilentLink(url.host or "127.0.0.1",
                        url.port or (5432 if url.get_backend_name() == "postgresql" else 3306))
    yield silent
    silent.close()


@pytest.fixture
def linked_url(server_url: str, link: SilentLink, table_prefix: str) -> Iterator[str]:
    """The store's URL through the link (its tables migrated directly)."""
    store = Store(server_url, table_prefix)
    store.migrate()
    yield make_url(server_url).set(host="127.0.0.1", port=link.port).render_as_string(
        hide_password=False)
    store.dispose()


def _in_thread(fn: object, bound: float) -> tuple[threading.Thread, dict[str, object]]:
    """Run ``fn`` in a thread whose store operations are bounded to ``bound`` seconds."""
    out: dict[str, object] = {}

    def run() -> None:
        deadlines.thread_bound(bound)
        started = time.monotonic()
        try:
            out["value"] = fn()  # type: ignore[operator]
        except Exception as exc:
            out["error"] = exc
        out["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_bounded_operation_on_a_silent_store_fails_within_its_deadline(
        linked_url: str, link: SilentLink, table_prefix: str) -> None:
    store = Store(linked_url, table_prefix)
    me = owner("silent@host")
    try:
        store.register(me, liveness.current(), 30)
        assert store.heartbeat(me, 30) is True
        link.silence()
        thread, out = _in_thread(lambda: store.heartbeat(me, 30), 1.5)
        thread.join(15)
        assert not thread.is_alive(), "the bounded renewal still waits on the silent link"
        assert isinstance(out.get("error"), StoreUnavailable), out
        assert "did not answer within 1.5s" in str(out["error"])
        assert 1.4 < float(out["took"]) < 5.0, out  # type: ignore[arg-type]
        link.resume()
        thread, out = _in_thread(lambda: store.heartbeat(me, 30), 1.5)
        thread.join(15)
        assert out.get("value") is True, out
    finally:
        link.resume()
        store.dispose()


def test_an_unbounded_thread_is_left_to_wait(linked_url: str, link: SilentLink,
                                             table_prefix: str) -> None:
    """Deadlines apply where a thread asked for them: a pool process's own statements wait
    (the fence stops that process instead), and come back when the link answers."""
    store = Store(linked_url, table_prefix)
    me = owner("patient@host")
    try:
        store.register(me, liveness.current(), 30)
        link.silence()
        thread, out = _in_thread(lambda: store.heartbeat(me, 30), None)  # type: ignore[arg-type]
        thread.join(3)
        assert thread.is_alive(), f"it returned while the link was silent: {out}"
        link.resume()
        thread.join(15)
        assert out.get("value") is True, out
    finally:
        link.resume()
        store.dispose()


def _runtime(url: str, prefix: str) -> Resilient:
    app = Celery(f"silent-{os.getpid()}-{time.monotonic_ns()}", set_as_current=False)
    app.conf.update(resilient_store_url=url, resilient_table_prefix=prefix,
                    resilient_lease_seconds=6, resilient_heartbeat_interval=1)
    return Resilient(app)


def test_the_guard_fences_on_time_while_renewals_and_pings_hang(
        linked_url: str, link: SilentLink, table_prefix: str,
        caplog: pytest.LogCaptureFixture) -> None:
    rt = _runtime(linked_url, table_prefix)
    me = owner("stalled@host")
    rt.store.register(me, liveness.current(), rt.config.lease_seconds)
    keeper = LeaseKeeper(rt, me)
    fence = Fence()
    guard = FencingGuard(rt, me, keeper, fence)
    guard.open_session()
    assert guard.describe() == "session"
    keeper.start()
    guard.start()
    try:
        wait_for(lambda: keeper.renewals >= 2, 10, "renewals through the link")
        with caplog.at_level(logging.INFO, logger="celery_resilient"):
            link.silence()
            silenced = time.monotonic()
            last_sent = keeper.renewal_sent_at
            wait_for(lambda: fence.engaged, 15, "the fence to engage")
            engaged_after = time.monotonic() - last_sent
            # engaged at the fence deadline (lease - margin = 5 s after the last renewal
            # sent), within the guard's tick; not when the link answers again
            assert rt.config.fence_after <= engaged_after <= rt.config.fence_after + 1.0, (
                engaged_after)
            assert link.silent
            wait_for(lambda: "did not answer within" in caplog.text, 10,
                     "a renewal to be given up")
            wait_for(lambda: "the liveness session was lost" in caplog.text, 10,
                     "the ping to be given up")
            wait_for(lambda: time.monotonic() - silenced > 12, 20, "a long silence")
            assert fence.engaged
            link.resume()
            resumed = time.monotonic()
            wait_for(lambda: not fence.engaged, 30, "the fence to lift by itself")
            print(f"fenced {engaged_after:.2f}s after the last renewal; lifted "
                  f"{time.monotonic() - resumed:.1f}s after the link answered")
        assert "SELF-FENCING (lease)" in caplog.text
        assert guard.session is not None
        wait_for(lambda: guard.session is not None and guard.session.held, 15,
                 "the liveness session to be held again")
    finally:
        link.resume()
        guard.stop()
        keeper.stop()
        guard.join(10)
        keeper.join(10)
        guard.close()
        rt.store.dispose()
