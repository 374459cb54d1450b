"""Startup warnings for time limits the broker will not tolerate."""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Queue

from celery_resilient import ResumableTask
from celery_resilient.broker import selection
from celery_resilient.worker.checks import time_limit_warnings


def _app(broker: str, **conf: Any) -> Celery:
    app = Celery("checks", broker=broker, set_as_current=False)
    app.conf.update(conf)

    @app.task(base=ResumableTask, bind=True, shared=False, name="checks.long", time_limit=7200)
    def long(self: ResumableTask) -> None:
        """Never run."""

    @app.task(base=ResumableTask, bind=True, shared=False, name="checks.short", time_limit=60)
    def short(self: ResumableTask) -> None:
        """Never run."""

    @app.task(shared=False, name="checks.plain", time_limit=99999)
    def plain() -> None:
        """Not resumable: not our business."""

    return app


def test_redis_visibility_timeout_shorter_than_a_time_limit_is_named() -> None:
    warnings = time_limit_warnings(_app("redis://127.0.0.1:6379/0"))
    assert len(warnings) == 1
    assert "checks.long" in warnings[0] and "visibility_timeout" in warnings[0]


def test_raised_visibility_timeout_silences_the_warning() -> None:
    app = _app("redis://127.0.0.1:6379/0",
               broker_transport_options={"visibility_timeout": 10_000})
    assert time_limit_warnings(app) == []


def test_the_reliable_fetch_silences_the_warning() -> None:
    """A live worker's holding keeps kombu's visibility restore away from its messages."""
    app = _app("redis://127.0.0.1:6379/0")
    assert selection.apply(app, True) == "on"
    assert time_limit_warnings(app) == []


def test_rabbitmq_consumer_timeout_is_named() -> None:
    warnings = time_limit_warnings(_app("amqp://guest@127.0.0.1//"))
    assert len(warnings) == 1 and "consumer_timeout" in warnings[0]


def test_global_time_limit_counts_too() -> None:
    app = Celery("checks-global", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    app.conf.task_time_limit = 5000

    @app.task(base=ResumableTask, bind=True, shared=False, name="checks.nolimit")
    def nolimit(self: ResumableTask) -> None:
        """Never run."""

    assert any("checks.nolimit" in w for w in time_limit_warnings(app))


def test_a_queues_own_consumer_timeout_is_the_one_judged() -> None:
    """x-consumer-timeout on the task's queue (milliseconds) overrides what the settings say
    of the server, both ways."""
    longer = _app("amqp://guest@127.0.0.1//", task_default_queue="work",
                  task_queues=[Queue("work", queue_arguments={"x-consumer-timeout": 9_000_000})])
    assert time_limit_warnings(longer) == []
    shorter = _app("amqp://guest@127.0.0.1//", task_default_queue="work",
                   broker_transport_options={"consumer_timeout_seconds": 99_999},
                   task_queues=[Queue("work", queue_arguments={"x-consumer-timeout": 30_000})])
    warnings = time_limit_warnings(shorter)
    assert len(warnings) == 2 and all("queue work's x-consumer-timeout" in w for w in warnings)
