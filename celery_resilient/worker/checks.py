"""Startup self-checks: settings the broker imposes that silently break resilience."""

from __future__ import annotations

import logging
from typing import Any

from celery_resilient.broker import selection
from celery_resilient.tasks.task import ResumableTask

log = logging.getLogger(__name__)
REDIS_DEFAULT_VISIBILITY = 3600.0
RABBITMQ_DEFAULT_CONSUMER_TIMEOUT = 1800.0


def time_limit_warnings(app: Any) -> list[str]:
    """Warnings for resumable tasks whose time limit outlives the broker's patience."""
    scheme = (app.conf.broker_url or "").split("://", 1)[0].split("+", 1)[0].lower()
    opts = app.conf.broker_transport_options or {}
    warnings: list[str] = []
    for task in list(app.tasks.values()):
        if not isinstance(task, ResumableTask):
            continue
        limit = task.time_limit or app.conf.task_time_limit
        if not limit:
            continue
        if scheme in ("redis", "rediss", "sentinel") and not selection.is_on(app.conf):
            # (with the reliable fetch a live worker's holding keeps kombu's restore away)
            visibility = float(opts.get("visibility_timeout", REDIS_DEFAULT_VISIBILITY))
            if limit > visibility:
                warnings.append(
                    f"{task.name}: time limit {limit}s exceeds the Redis visibility_timeout "
                    f"({visibility}s); Redis will redeliver it while it runs. Raise "
                    "broker_transport_options['visibility_timeout'] above the time limit "
                    "(duplicates are skipped by the store, but each costs a delivery)."
                )
        elif scheme in ("amqp", "amqps", "pyamqp"):
            timeout = float(opts.get("consumer_timeout_seconds",
                                     RABBITMQ_DEFAULT_CONSUMER_TIMEOUT))
            if limit > timeout:
                warnings.append(
                    f"{task.name}: time limit {limit}s exceeds RabbitMQ's consumer_timeout "
                    f"({timeout}s by default); the broker will close the channel. Raise "
                    "consumer_timeout in rabbitmq.conf (or per queue with x-consumer-timeout)."
                )
    return warnings
