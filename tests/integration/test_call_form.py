"""A claim taken before its receipt was flushed keeps a re-publishable (call-form) message."""

from __future__ import annotations

import json

from celery import Celery

from celery_resilient import ResumableTask
from celery_resilient.core import messages


def test_call_form_message_republishes_same_task_id_and_arguments(redis_url: str,
                                                                  queue_name: str) -> None:
    app = Celery("callform", broker=redis_url, set_as_current=False)
    app.conf.task_default_queue = queue_name

    @app.task(base=ResumableTask, bind=True, shared=False, name="callform.ingest")
    def ingest(self: ResumableTask, path: str, rows: int = 1) -> None:
        """Never run here: only its signature is built."""

    sig = ingest.signature(("a.csv",), {"rows": 3}, task_id="call-form-1",
                           headers={"work_key": "ingest:a.csv"})
    stored = messages.from_signature(sig)
    assert stored is not None and "signature" in json.loads(stored)

    with app.connection_for_write() as conn:
        messages.publish(conn, stored, {"resilient_republished": 1}, app)
        with conn.SimpleQueue(queue_name) as queue:
            message = queue.get(timeout=5)
            message.ack()
    assert message.headers["id"] == "call-form-1"
    assert message.headers["task"] == "callform.ingest"
    assert message.headers["resilient_republished"] == 1
    assert message.headers["work_key"] == "ingest:a.csv"
    args, kwargs, _ = message.decode()
    assert args == ["a.csv"] and kwargs == {"rows": 3}
    app.close()


def test_unserialisable_arguments_give_no_call_form() -> None:
    app = Celery("callform2", set_as_current=False)

    @app.task(base=ResumableTask, bind=True, shared=False, name="callform.other")
    def other(self: ResumableTask, thing: object) -> None:
        """Never run here."""

    assert messages.from_signature(other.signature((object(),))) is None
