"""A real serialization failure inside ``ledger.atomic`` is a store outage, not a failure.

A real ``celery worker`` runs ``tests/e2e/transientproj.py`` against the machine's PostgreSQL,
through connections that run SERIALIZABLE. On its first execution the task's atomic block loses
a write conflict (SQLSTATE 40001) to another client; the worker re-sends the message, the copy
runs the block again, and the work ends ``done`` exactly once: one booking row, the marker, and
SUCCESS for the caller.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import select

from celery_resilient.core import codec
from celery_resilient.testing import EffectLog, wait_for

from . import transientproj
from .conftest import Project

pytestmark = pytest.mark.postgres
SERIALIZABLE = "?options=-c%20default_transaction_isolation%3Dserializable"
SETTLE = 60.0


def test_serialization_failure_in_atomic_block_ends_done_exactly_once(
        make_project: Callable[..., Project], broker_url: str, pg_url: str, redis_url: str,
        effect_log: EffectLog) -> None:
    project = make_project(broker_url, pg_url + SERIALIZABLE)
    project.extra = {"resilient_store_retry_base": 0.2, "resilient_store_retry_max": 1}
    env = {**project.env(), "RESILIENT_RESULT_BACKEND": redis_url}
    seats, bookings = transientproj.tables(project.prefix)
    seats.metadata.create_all(project.store.engine)
    with project.store.engine.begin() as conn:
        conn.execute(seats.insert().values(id=1, free=transientproj.SEATS))
    worker = project.nodes.worker(transientproj.NAME, name="transient",
                                  queues=(project.queue,), env=env)
    client = transientproj.create_app(env)
    task_id = f"book-{uuid.uuid4().hex[:12]}"
    client.send_task(f"{transientproj.NAME}.book", task_id=task_id, queue=project.queue)

    wait_for(lambda: project.state(task_id) == "done", SETTLE, "the booking to end done")
    meta = wait_for(lambda: (m := client.backend.get_task_meta(task_id, cache=False))
                    ["status"] == "SUCCESS" and m, SETTLE, "SUCCESS for the caller")
    assert meta["result"] == f"booked {task_id}"

    # The first execution lost the conflict and was re-sent as a store outage, not failed.
    logs = worker.process.logs()
    assert re.search(rf"store unavailable \(.*?40001.*?\); {re.escape(task_id)} re-sent in",
                     logs, flags=re.DOTALL), logs[-3000:]
    # A conflict the store answered with is not an outage: intake is not paused for it.
    assert "paused consuming" not in logs, logs[-3000:]
    assert effect_log.count(f"conflict:{task_id}") == 1
    runs = effect_log.entries(f"run:{task_id}")
    assert [(r["epoch"], r["attempt"]) for r in runs] == [(1, 1), (2, 2)]
    row = project.store.get_work(task_id)
    assert row is not None
    assert (row.state, row.attempts, row.deaths, row.error) == ("done", 2, 0, None)
    assert codec.decode(row.result_json) == f"booked {task_id}"

    # The user's writes landed once, with the marker: one booking, one seat of ours.
    with project.store.engine.connect() as conn:
        booked = conn.execute(select(bookings.c.work_key, bookings.c.seat)).all()
        free = conn.execute(select(seats.c.free).where(seats.c.id == 1)).scalar_one()
        conn.rollback()
    assert [(b.work_key, b.seat) for b in booked] == [(task_id, 1)]
    assert free == transientproj.SEATS - 2  # the other client's seat and ours
    assert project.store.ledger_get(f"{task_id}:atomic") is not None
