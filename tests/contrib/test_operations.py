"""``operations.republish`` (an operator re-sends dead or stuck work, on purpose), and how it
hands work that ended by its own request over to ``operations.retry``.

Against real stores (SQLite and PostgreSQL) and a real Redis broker; the last test lets a
real worker run work that was parked as dead, once, after it is re-published.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_resilient import Resilient
from celery_resilient.core import messages
from celery_resilient.core.identity import Owner
from celery_resilient.ops.operations import (
    RepublishRefused,
    Selection,
    cancel,
    republish,
    retry,
    without_expiry,
)
from celery_resilient.store.sql import Store
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.plugin import NodeFactory

from .django import helpers


@pytest.fixture
def runtime(store: Store, redis_url: str, queue_name: str) -> Iterator[Resilient]:
    app = Celery("ops", broker=redis_url, set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix)
    rt = Resilient(app)
    yield rt
    rt.store.dispose()
    with Connection(redis_url) as conn:
        conn.default_channel.client.delete(queue_name)
    app.close()


def _drain(redis_url: str, queue: str) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    with Connection(redis_url) as conn:
        while (message := conn.default_channel.basic_get(queue)) is not None:
            got.append(dict(message.headers))
            message.ack()
    return got


def test_dead_work_is_requeued_with_its_deaths_reset_and_sent_again(
        runtime: Resilient, store: Store, queue_name: str, redis_url: str) -> None:
    helpers.dead(store, "ops-dead", queue_name)
    before = store.get_work("ops-dead")
    assert before is not None and before.state == "dead" and before.deaths == 1

    done = republish(runtime, "ops-dead")
    assert (done.previous_state, done.deaths_reset, done.task_id) == ("dead", True, "ops-dead")
    row = store.get_work("ops-dead")
    assert row is not None and row.state == "requeued"
    assert (row.deaths, row.attempts, row.republished) == (0, before.attempts, 2)
    assert row.error is None and row.owner_node is None
    assert row.lease_expires_at is not None and row.lease_expires_at > store.now()
    sent = _drain(redis_url, queue_name)
    assert [(h["id"], h["resilient_republished"]) for h in sent] == [("ops-dead", 1)]


@pytest.mark.parametrize(("make", "why"), [
    (helpers.running, "live lease"),
    (helpers.done, "already done"),
    (lambda s, k, q: None, "no such work"),
])
def test_refusals_change_nothing_and_send_nothing(
        runtime: Resilient, store: Store, queue_name: str, redis_url: str,
        make: Any, why: str) -> None:
    make(store, "ops-x", queue_name)
    before = store.get_work("ops-x")
    with pytest.raises(RepublishRefused, match=why):
        republish(runtime, "ops-x")
    assert store.get_work("ops-x") == before
    assert _drain(redis_url, queue_name) == []


def test_failed_work_and_work_without_a_message_are_refused(
        runtime: Resilient, store: Store, queue_name: str) -> None:
    epoch = helpers.running(store, "ops-failed", queue_name)
    store.fail("ops-failed", epoch, "ValueError: bad row")
    with pytest.raises(RepublishRefused, match=r"ValueError: bad row.*send a new task"):
        republish(runtime, "ops-failed")
    # Taken by a pool process without any receipt: no message was ever stored.
    owner = Owner("w@host", "inc-9", 9)
    store.take("ops-nomsg", helpers.TASK, "ops-nomsg", None, owner, -5, 5,
               is_live=lambda *_: False)
    with pytest.raises(RepublishRefused, match="no broker message is stored"):
        republish(runtime, "ops-nomsg")


def test_work_ended_by_its_request_is_refused_with_a_pointer_to_retry(
        runtime: Resilient, store: Store, queue_name: str, redis_url: str) -> None:
    helpers.revoked(store, "ops-revoked", queue_name)
    helpers.reserved(store, "ops-cancelled", queue_name)
    cancel(runtime, Selection(keys=("ops-cancelled",)))
    for key, state in (("ops-revoked", "revoked"), ("ops-cancelled", "cancelled")):
        before = store.get_work(key)
        with pytest.raises(RepublishRefused, match=rf"ended as {state} .*use retry"):
            republish(runtime, key)
        assert store.get_work(key) == before
    assert _drain(redis_url, queue_name) == []

    report = retry(runtime, Selection(keys=("ops-revoked", "ops-cancelled")))
    assert report.ok and [t.previous_state for t in report.changed] == ["revoked", "cancelled"]
    assert sorted(h["id"] for h in _drain(redis_url, queue_name)) == [
        "ops-cancelled", "ops-revoked"]


def test_without_expiry_drops_the_deadline_in_both_stored_forms() -> None:
    app = Celery("ops-expiry", set_as_current=False)
    call_form = messages.from_signature(app.signature(
        "proj.job", args=(1,), options={"expires": 30, "task_id": "t-1"}))
    assert call_form is not None
    dropped = json.loads(without_expiry(call_form))
    assert dropped["signature"]["options"] == {"task_id": "t-1"}
    headers = json.loads(helpers.message("t-2", "q"))
    headers["headers"]["expires"] = "2001-01-01T00:00:00+00:00"
    assert json.loads(without_expiry(json.dumps(headers)))["headers"]["expires"] is None
    plain = helpers.message("t-3", "q")
    assert without_expiry(plain) == plain  # nothing to drop: the exact stored text
    app.close()


def test_refused_exception_survives_pickling() -> None:
    import pickle

    err = RepublishRefused("cannot re-publish 'k': it is already done")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


@pytest.mark.e2e
@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_republished_dead_work_runs_once_on_a_real_worker(
        runtime: Resilient, store: Store, resilient_nodes: NodeFactory,
        effect_log: EffectLog, queue_name: str, redis_url: str) -> None:
    client = Celery("flaskproj-client", broker=redis_url, set_as_current=False)
    client.send_task("flaskproj.greet", args=(["ada"],), task_id="greet-dead",
                     queue=queue_name)
    client.close()
    with Connection(redis_url) as conn:  # take the real message off the queue
        raw = wait_for(lambda: conn.default_channel.basic_get(queue_name), 10,
                       "the sent message")
        message_json = messages.from_kombu(raw)
        raw.ack()
    doomed = Owner("gone@host", "inc-1", 1)
    store.record_receipt("greet-dead", "flaskproj.greet", "greet-dead", None, message_json,
                         doomed, 60)
    store.take("greet-dead", "flaskproj.greet", "greet-dead", None, doomed, 60, 5,
               is_live=lambda *_: True)
    store.register(doomed, "", 60)
    store.declare_dead(doomed.incarnation)  # the next start proved it dead
    store.claim_orphans(Owner("gone@host", "inc-2", 2), 10, 60)
    parked = store.take("greet-dead", "flaskproj.greet", "greet-dead", None,
                        Owner("gone@host", "inc-2", 2), 60, 1, is_live=lambda *_: False)
    assert parked.action == "dead"

    env = {"FLASKPROJ_RESILIENT_STORE_URL": store.url,
           "FLASKPROJ_RESILIENT_TABLE_PREFIX": store.prefix,
           "FLASKPROJ_BROKER": redis_url, "FLASKPROJ_QUEUE": queue_name,
           "FLASKPROJ_GREETING": "welcome back"}
    resilient_nodes.worker("tests.contrib.flaskproj:celery_app", env=env, queues=(queue_name,))
    republish(runtime, "greet-dead")

    def state() -> str | None:
        row = store.get_work("greet-dead")
        return None if row is None else row.state

    wait_for(lambda: state() == "done", 60, "the re-published work to finish")
    row = store.get_work("greet-dead")
    assert row is not None and row.deaths == 0 and row.epoch == 2
    effect_log.assert_exactly_once({"greet:greet-dead:ada"})
