"""Durable submit: the store records the work before the broker sees it, or nothing is sent."""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_resilient import Resilient, ResumableTask, StoreUnavailable
from celery_resilient.store.sql import Store
from celery_resilient.testing.services import free_port


def _app(store_url: str, broker: str, queue: str, prefix: str) -> Celery:
    app = Celery("durable", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue=queue, resilient_durable_submit=True,
                    resilient_store_url=store_url, resilient_table_prefix=prefix,
                    resilient_auto_migrate=True)
    Resilient(app)

    @app.task(base=ResumableTask, bind=True, shared=False, name="durable.job")
    def job(self: ResumableTask, n: int) -> int:
        """Never run here."""
        return n

    return app


def test_store_down_raises_before_anything_is_published(redis_url: str, queue_name: str,
                                                        table_prefix: str) -> None:
    dead_store = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    app = _app(dead_store, redis_url, queue_name, table_prefix)
    with pytest.raises(StoreUnavailable):
        app.tasks["durable.job"].apply_async((1,), task_id="never-sent")
    assert redis.Redis.from_url(redis_url).llen(queue_name) == 0, "published without a record"
    app.close()


def test_submission_is_recorded_then_published(redis_url: str, pg_url: str, queue_name: str,
                                               table_prefix: str) -> None:
    app = _app(pg_url, redis_url, queue_name, table_prefix)
    result = app.tasks["durable.job"].apply_async((7,), headers={"work_key": "job:7"})
    store = Store(pg_url, table_prefix)
    try:
        row = store.get_work("job:7")
        assert row is not None and row.state == "requeued" and row.task_id == result.id
        assert store.get_message("job:7") is not None
        assert redis.Redis.from_url(redis_url).llen(queue_name) == 1
    finally:
        store.dispose()
        redis.Redis.from_url(redis_url).delete(queue_name)
        app.close()


def test_a_running_task_re_sending_itself_needs_no_store(redis_url: str, queue_name: str,
                                                         table_prefix: str) -> None:
    """A store-outage re-send of the running execution must still reach the broker.

    (Found by the chaos soak: the re-send went through durable submit, failed on the dead
    store, and the requeued copy without its supersedes header was skipped as held.)
    """
    dead_store = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
    app = _app(dead_store, redis_url, queue_name, table_prefix)
    task = app.tasks["durable.job"]
    task.push_request(id="running-1")
    try:
        task.apply_async((1,), task_id="running-1")
    finally:
        task.pop_request()
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.llen(queue_name) == 1
    finally:
        client.delete(queue_name)
        app.close()
