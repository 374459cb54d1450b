"""The read-only admin over the store's tables, and its operator actions (re-publish,
cancel, retry, forget), each behind its own permission.

Rows are made through the store's own API in the test database; pages are rendered by
Django's test client; the re-publish action sends real messages to Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth.models import Permission, User
from django.test import Client
from kombu import Connection
from sqlalchemy import select

from celery_resilient import Resilient
from celery_resilient.core import codec
from celery_resilient.errors import WorkStopped
from celery_resilient.store.contexts import ContextRows
from celery_resilient.store.schedule import ScheduleStore
from celery_resilient.store.sql import Store

from . import helpers

WORK_URL = "/admin/celery_resilient/work/"


@pytest.fixture
def store(project_app: Celery) -> Store:
    return Resilient.of(project_app).store


@pytest.fixture
def queue(queue_name: str, redis_url: str) -> Iterator[str]:
    yield queue_name
    with Connection(redis_url) as conn:
        conn.default_channel.client.delete(queue_name)


def _drain(redis_url: str, queue: str) -> list[dict[str, Any]]:
    """Every message waiting in ``queue`` (their headers)."""
    got: list[dict[str, Any]] = []
    with Connection(redis_url) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue)) is not None:
            got.append(dict(message.headers))
            message.ack()
    return got


def test_work_list_shows_state_owner_lease_attempts_and_checkpoint(
        admin_client: Client, store: Store, queue: str) -> None:
    helpers.dead(store, "job-dead", queue)  # first: its sweep would also take job-stuck
    epoch = helpers.running(store, "job-live", queue)
    store.save_checkpoint("job-live", epoch, codec.encode({"row": 3}, "checkpoint"))
    helpers.running(store, "job-stuck", queue, lease=-5)

    page = admin_client.get(WORK_URL).content.decode()
    for key in ("job-live", "job-stuck", "job-dead"):
        assert key in page
    assert "live@host" in page and "s left" in page and "expired" in page
    assert "#1 at" in page  # the live job's checkpoint: sequence and time

    dead_only = admin_client.get(WORK_URL, {"state__exact": "dead"}).content.decode()
    assert "job-dead" in dead_only and "job-live" not in dead_only
    expired = admin_client.get(WORK_URL, {"lease": "expired"}).content.decode()
    assert "job-stuck" in expired and "job-live" not in expired
    found = admin_client.get(WORK_URL, {"q": "job-li"}).content.decode()
    assert "job-live" in found and "job-dead" not in found


def test_work_detail_is_view_only_with_checkpoint_and_message(
        admin_client: Client, store: Store, queue: str) -> None:
    epoch = helpers.running(store, "job-1", queue)
    store.save_checkpoint("job-1", epoch, codec.encode({"row": 3}, "checkpoint"))
    response = admin_client.get(f"{WORK_URL}job-1/change/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "&quot;row&quot;: 3" in page  # the checkpoint's state, pretty-printed
    assert helpers.TASK in page  # the stored message's headers
    assert 'name="_save"' not in page

    assert admin_client.get(f"{WORK_URL}add/").status_code == 403
    posted = admin_client.post(f"{WORK_URL}job-1/change/", {"state": "done"})
    assert posted.status_code == 403
    assert admin_client.post(f"{WORK_URL}job-1/delete/", {"post": "yes"}).status_code == 403
    row = store.get_work("job-1")
    assert row is not None and row.state == "running"


def test_slots_markers_contexts_and_workers_are_listed(admin_client: Client,
                                                       store: Store) -> None:
    schedule = ScheduleStore(store)
    schedule.claim("nightly", "beat-1", [(1_700_000_000.0, "tid-sent")],
                   [(1_699_990_000.0, "tid-skipped")], marker=1_700_000_000.0)
    ContextRows(store).create("session:42", codec.encode({"cart": ["apple"]}, "context"))
    store.heartbeat(helpers.LIVE, 30)

    slots = admin_client.get("/admin/celery_resilient/schedulerun/").content.decode()
    assert "nightly" in slots and "tid-sent" in slots and "tid-skipped" in slots
    skipped = admin_client.get("/admin/celery_resilient/schedulerun/",
                               {"state__exact": "skipped"}).content.decode()
    assert "tid-skipped" in skipped and "tid-sent" not in skipped
    markers = admin_client.get("/admin/celery_resilient/schedulemarker/").content.decode()
    assert "nightly" in markers and "Nov. 14, 2023, 10:13 p.m." in markers  # UTC

    contexts = admin_client.get("/admin/celery_resilient/context/",
                                {"updated": "1h"}).content.decode()
    assert "session:42" in contexts
    old = admin_client.get("/admin/celery_resilient/context/",
                           {"updated": "older"}).content.decode()
    assert "session:42" not in old
    detail = admin_client.get("/admin/celery_resilient/context/session:42/change/")
    assert "apple" in detail.content.decode()

    workers = admin_client.get("/admin/celery_resilient/workerincarnation/").content.decode()
    assert "inc-live" in workers and "live@host" in workers


def test_republish_action_sends_dead_and_stuck_work_and_refuses_the_rest(
        admin_client: Client, store: Store, queue: str, redis_url: str) -> None:
    helpers.dead(store, "job-dead", queue)
    helpers.running(store, "job-stuck", queue, lease=-5)
    live_epoch = helpers.running(store, "job-live", queue)
    helpers.done(store, "job-done", queue)
    assert _drain(redis_url, queue) == []

    response = admin_client.post(WORK_URL, {
        "action": "republish_selected",
        "_selected_action": ["job-dead", "job-stuck", "job-live", "job-done"],
    }, follow=True)
    assert response.status_code == 200
    notes = [str(m) for m in response.context["messages"]]
    assert any("re-published 2 unit(s) of work" in n for n in notes), notes
    assert any("'job-live'" in n and "live lease" in n for n in notes), notes
    assert any("'job-done'" in n and "already done" in n for n in notes), notes

    sent = _drain(redis_url, queue)
    assert sorted(h["id"] for h in sent) == ["job-dead", "job-stuck"]
    assert all(h["resilient_republished"] == 1 and h["task"] == helpers.TASK for h in sent)

    was_dead = store.get_work("job-dead")
    assert was_dead is not None and was_dead.state == "requeued"
    assert was_dead.deaths == 0 and was_dead.republished == 2 and was_dead.error is None
    stuck = store.get_work("job-stuck")
    assert stuck is not None and stuck.state == "requeued" and stuck.deaths == 1
    live = store.get_work("job-live")
    assert live is not None and live.state == "running" and live.epoch == live_epoch
    finished = store.get_work("job-done")
    assert finished is not None and finished.state == "done"


def test_republish_needs_its_own_permission(client: Client, store: Store, queue: str,
                                            redis_url: str) -> None:
    helpers.dead(store, "job-dead", queue)
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_work"))
    client.force_login(viewer)
    page = client.get(WORK_URL)
    assert page.status_code == 200 and "job-dead" in page.content.decode()
    assert "republish_selected" not in page.content.decode()
    client.post(WORK_URL, {"action": "republish_selected", "_selected_action": ["job-dead"]})
    row = store.get_work("job-dead")
    assert row is not None and row.state == "dead"
    assert _drain(redis_url, queue) == []

    operator = User.objects.create_user("operator", password="pw", is_staff=True)
    operator.user_permissions.add(Permission.objects.get(codename="view_work"),
                                  Permission.objects.get(codename="republish_work"))
    client.force_login(operator)
    assert "republish_selected" in client.get(WORK_URL).content.decode()
    client.post(WORK_URL, {"action": "republish_selected", "_selected_action": ["job-dead"]})
    assert [h["id"] for h in _drain(redis_url, queue)] == ["job-dead"]


def _act(client: Client, name: str, keys: list[str]) -> list[str]:
    response = client.post(WORK_URL, {"action": name, "_selected_action": keys}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def _tombstones(store: Store) -> set[str]:
    rv = store.t.revocations
    with store.engine.connect() as conn:
        found = {str(x) for x in conn.execute(select(rv.c.task_id)).scalars()}
        conn.rollback()
    return found


def test_cancel_action_stops_running_work_and_names_what_it_refused(
        admin_client: Client, store: Store, queue: str) -> None:
    epoch = helpers.running(store, "job-run", queue)
    helpers.reserved(store, "job-waiting", queue)
    helpers.done(store, "job-done", queue)

    notes = _act(admin_client, "cancel_selected", ["job-run", "job-waiting", "job-done"])
    assert any("cancelled 2 unit(s) of work" in n for n in notes), notes
    assert any("cannot cancel 'job-done'" in n and "already ended (done)" in n
               for n in notes), notes
    row = store.get_work("job-run")
    assert row is not None and row.state == "cancelled"
    assert row.error == "cancelled by operator: by admin in the Django admin"
    with pytest.raises(WorkStopped):
        store.save_checkpoint("job-run", epoch, codec.encode({"row": 9}, "checkpoint"))
    waiting = store.get_work("job-waiting")
    assert waiting is not None and waiting.state == "cancelled"
    finished = store.get_work("job-done")
    assert finished is not None and finished.state == "done"


def test_retry_action_sends_ended_work_again_and_refuses_done_and_open_work(
        admin_client: Client, store: Store, queue: str, redis_url: str) -> None:
    helpers.revoked(store, "job-revoked", queue)
    helpers.failed(store, "job-failed", queue)
    helpers.done(store, "job-done", queue)
    helpers.reserved(store, "job-open", queue)
    assert _tombstones(store) == {"job-revoked"}

    notes = _act(admin_client, "retry_selected",
                 ["job-revoked", "job-failed", "job-done", "job-open"])
    assert any("retried 2 unit(s) of work" in n for n in notes), notes
    assert any("cannot retry 'job-done'" in n and "it is done" in n for n in notes), notes
    assert any("cannot retry 'job-open'" in n and "still open (reserved)" in n
               for n in notes), notes
    assert sorted(h["id"] for h in _drain(redis_url, queue)) == ["job-failed", "job-revoked"]
    assert _tombstones(store) == set()
    for key in ("job-revoked", "job-failed"):
        row = store.get_work(key)
        assert row is not None and (row.state, row.deaths, row.error) == ("requeued", 0, None)
    outcome = store.take("job-revoked", helpers.TASK, "job-revoked", None, helpers.LIVE, 60,
                         5, is_live=lambda *_: True)
    assert outcome.action == "run"


def test_forget_action_deletes_ended_work_but_not_open_work_or_ledger(
        admin_client: Client, store: Store, queue: str) -> None:
    epoch = helpers.running(store, "job-failed", queue)
    store.save_checkpoint("job-failed", epoch, codec.encode({"row": 3}, "checkpoint"))
    assert store.ledger_put("mail:job-failed", "job-failed", epoch, '"sent"')
    store.fail("job-failed", epoch, "boom")
    helpers.running(store, "job-live", queue)

    notes = _act(admin_client, "forget_selected", ["job-failed", "job-live"])
    assert any("forgot 1 unit(s) of work with 1 checkpoint(s) and 0 step(s)" in n
               for n in notes), notes
    assert any("cannot forget 'job-live'" in n and "still open (running)" in n
               for n in notes), notes
    assert store.get_work("job-failed") is None
    assert store.load_checkpoint("job-failed") is None
    assert store.ledger_get("mail:job-failed") == '"sent"'
    live = store.get_work("job-live")
    assert live is not None and live.state == "running"


@pytest.mark.parametrize("codename", ["cancel_work", "retry_work", "forget_work"])
def test_each_action_needs_its_own_permission(client: Client, store: Store, queue: str,
                                              codename: str) -> None:
    helpers.reserved(store, "job-open", queue)
    helpers.failed(store, "job-failed", queue)
    actions = {"cancel_work": "cancel_selected", "retry_work": "retry_selected",
               "forget_work": "forget_selected"}
    user = User.objects.create_user("operator", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_work"),
                              Permission.objects.get(codename=codename))
    client.force_login(user)
    page = client.get(WORK_URL).content.decode()
    for perm, name in actions.items():
        assert (name in page) == (perm == codename), (perm, name)
    assert "republish_selected" not in page
    before = {k: store.get_work(k) for k in ("job-open", "job-failed")}
    for perm, name in actions.items():
        if perm != codename:  # not offered, so posting it does nothing
            client.post(WORK_URL, {"action": name,
                                   "_selected_action": ["job-open", "job-failed"]})
    assert {k: store.get_work(k) for k in before} == before
