"""e2e fixtures: a project environment (broker, store, queue) for real worker processes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_resilient.core.states import UNSTARTED_PID
from celery_resilient.store.sql import Store
from celery_resilient.testing.clients import close_result_client  # noqa: F401  (re-exported to the tests)
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.plugin import NodeFactory


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e starts real processes: mark it so `-m "not e2e"` works."""
    for item in items:
        if "/tests/e2e/" in str(item.path):
            item.add_marker(pytest.mark.e2e)


class Project:
    """What a test needs to drive ``tests/e2e/proj.py`` workers and inspect the store."""

    def __init__(self, nodes: NodeFactory, broker: str, store_url: str, prefix: str,
                 queue: str) -> None:
        self.nodes = nodes
        self.broker = broker
        self.store_url = store_url
        self.prefix = prefix
        self.queue = queue
        self.extra: dict[str, Any] = {}
        self.store = Store(store_url, prefix)
        self.store.migrate()
        self.client = Celery("proj-client", broker=broker)
        self.client.conf.task_default_queue = queue

    def env(self) -> dict[str, str]:
        return {
            "RESILIENT_BROKER": self.broker,
            "RESILIENT_STORE_URL": self.store_url,
            "RESILIENT_TABLE_PREFIX": self.prefix,
            "RESILIENT_QUEUE": self.queue,
            "RESILIENT_EXTRA": json.dumps(self.extra),
        }

    def worker(self, name: str = "worker", concurrency: int = 1, **kwargs: Any) -> LocalWorker:
        return self.nodes.worker("tests.e2e.proj", name=name, concurrency=concurrency,
                                 queues=(self.queue,), env={**self.env(), **kwargs.pop("env", {})},
                                 **kwargs)

    def send(self, task: str, *args: Any, task_id: str | None = None, **options: Any) -> str:
        result = self.client.send_task(f"tests.e2e.proj.{task}", args=args, task_id=task_id,
                                       queue=self.queue, **options)
        return str(result.id)

    def state(self, work_key: str) -> str | None:
        row = self.store.get_work(work_key)
        return None if row is None else row.state

    def prefetched(self, work_key: str) -> bool:
        """Received by a worker and not started: ``reserved`` (its receipt), or ``running``
        and never seen to start (taken by the worker's batched takes, store/batched_takes.py)."""
        row = self.store.get_work(work_key)
        return row is not None and (row.state == "reserved" or (
            row.state == "running" and row.owner_pid == UNSTARTED_PID))

    def all_done(self, keys: list[str]) -> bool:
        return all(self.state(k) == "done" for k in keys)

    def close(self) -> None:
        self.store.dispose()
        self.client.close()


@pytest.fixture(params=["redis", "rabbitmq"])
def broker_url(request: pytest.FixtureRequest, redis_url: str, amqp_url: str) -> str:
    return redis_url if request.param == "redis" else amqp_url


@pytest.fixture
def make_project(table_prefix: str, resilient_nodes: NodeFactory, queue_name: str,
                 pg_url: str) -> Iterator[Callable[..., Project]]:
    made: list[Project] = []

    def make(broker: str, store_url: str | None = None) -> Project:
        project = Project(resilient_nodes, broker, store_url or pg_url, table_prefix, queue_name)
        made.append(project)
        return project

    yield make
    for project in made:
        project.close()


@pytest.fixture
def project(make_project: Callable[..., Project], broker_url: str) -> Project:
    """A project on PostgreSQL, parametrised over Redis and RabbitMQ brokers."""
    return make_project(broker_url)
