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


def _recorded(store: Store, task_id: str) -> bool:
    """Recorded under its default work key, the task id."""
    return store.get_work(task_id) is not None


def test_every_way_of_sending_is_recorded(redis_url: str, pg_url: str, queue_name: str,
                                          table_prefix: str) -> None:
    """send_task by name, a chain's first part, a group's parts, a countdown: each is in the
    store before the broker has it; a plain task and a task unknown here are not."""
    from celery import chain, group

    app = _app(pg_url, redis_url, queue_name, table_prefix)

    @app.task(shared=False, name="durable.plain")
    def plain() -> None:
        """Never run here."""

    job = app.tasks["durable.job"]
    client = redis.Redis.from_url(redis_url)
    store = Store(pg_url, table_prefix)
    try:
        by_name = app.send_task("durable.job", (1,))
        chained = chain(job.s(2), job.s()).apply_async()
        grouped = group(job.s(3), job.s(4)).apply_async()
        later = job.apply_async((5,), countdown=120)
        unknown = app.send_task("elsewhere.job", (6,))
        plain_id = plain.delay().id
        for result in (by_name, chained.parent, *grouped.results, later):
            assert _recorded(store, result.id), f"{result.id} sent without a store record"
        assert not _recorded(store, unknown.id) and not _recorded(store, plain_id)
        assert client.llen(queue_name) == 7, "every message still reached the broker"
        row = store.get_work(later.id)
        assert row is not None and row.lease_expires_at - row.updated_at >= 120 + 59, (
            "a countdown's submission is held past its countdown before a re-publish")
        assert '"eta"' in (store.get_message(later.id) or ""), "kept as an absolute time"
    finally:
        store.dispose()
        client.delete(queue_name)
        app.close()


def test_a_failed_publish_leaves_no_record(pg_url: str, queue_name: str,
                                           table_prefix: str) -> None:
    """As plain Celery sends nothing when apply_async raises, the store keeps nothing that
    would send it later behind the caller's back."""
    app = _app(pg_url, f"redis://127.0.0.1:{free_port()}/0", queue_name, table_prefix)
    app.conf.update(task_publish_retry=False, broker_connection_retry=False,
                    broker_connection_timeout=1)
    store = Store(pg_url, table_prefix)
    try:
        with pytest.raises(Exception) as raised:
            app.tasks["durable.job"].apply_async((1,), task_id="unpublished")
        assert not isinstance(raised.value, StoreUnavailable)
        assert store.get_work("unpublished") is None, "a record left for an unsent message"
    finally:
        store.dispose()
        app.close()


def test_a_broker_that_lost_its_data_gets_due_work_now_and_countdowns_later(
        redis_url: str, pg_url: str, queue_name: str, table_prefix: str) -> None:
    app = _app(pg_url, redis_url, queue_name, table_prefix)
    job = app.tasks["durable.job"]
    store = Store(pg_url, table_prefix)
    try:
        now_id = job.apply_async((1,)).id
        later_id = job.apply_async((2,), countdown=300).id
        done_id = job.apply_async((3,)).id
        assert store.park_unsendable(done_id, "ended")  # not waiting for the broker: left alone
        assert store.broker_lost(60.0) == 2  # resilient_submit_timeout, its default
        clock = store.now()
        due, later = store.get_work(now_id), store.get_work(later_id)
        assert due is not None and due.lease_expires_at is not None
        assert due.lease_expires_at <= clock, "a plain submission is due at once"
        assert later is not None and later.lease_expires_at is not None
        assert 290 < later.lease_expires_at - clock <= 300, "its countdown is kept"
    finally:
        store.dispose()
        redis.Redis.from_url(redis_url).delete(queue_name)
        app.close()
