"""Startup self-checks: settings the broker imposes that silently break resilience."""

from __future__ import annotations

import logging
from typing import Any

from celery_resilient.broker import selection
from celery_resilient.broker.identity import BrokerIdentity
from celery_resilient.core.identity import Owner
from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.engine import sanitize_url
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
            timeout, where = _consumer_timeout(app, task, opts)
            if limit > timeout:
                warnings.append(
                    f"{task.name}: time limit {limit}s exceeds RabbitMQ's consumer_timeout "
                    f"({timeout:g}s, {where}); the server will close the channel while it "
                    "runs. The worker opens it again and the task goes on, but every message "
                    "prefetched on that channel is redelivered. Raise consumer_timeout in "
                    "rabbitmq.conf, or per queue with the x-consumer-timeout argument "
                    "(RabbitMQ 3.12+), above the time limit."
                )
    return warnings


def _consumer_timeout(app: Any, task: Any, opts: dict[str, Any]) -> tuple[float, str]:
    """The consumer timeout ``task``'s queue runs under, as far as the worker can tell: the
    queue's own ``x-consumer-timeout`` argument when it declares one, else what
    ``broker_transport_options['consumer_timeout_seconds']`` says of the server, else
    RabbitMQ's default. (RabbitMQ does not tell a client the server's setting.)"""
    name = getattr(task, "queue", None) or app.conf.task_default_queue
    try:
        queue = app.amqp.queues.get(name)
    except Exception:  # routing not built here: judge by the settings
        queue = None
    declared = (getattr(queue, "queue_arguments", None) or {}).get("x-consumer-timeout")
    if declared is not None:
        return float(declared) / 1000, f"queue {name}'s x-consumer-timeout"
    if "consumer_timeout_seconds" in opts:
        return float(opts["consumer_timeout_seconds"]), "broker_transport_options"
    return RABBITMQ_DEFAULT_CONSUMER_TIMEOUT, "RabbitMQ's default"


def refuse_foreign_brokers(rt: Runtime, owner: Owner, mine: BrokerIdentity) -> None:
    """Refuse to start beside a live worker of this store that consumes from another broker.

    Each worker re-publishes the work the store holds (orphans, hand-offs, a lost broker's
    queue) into its own broker: two brokers on one store and table prefix would send each
    other's work where nobody consumes it. Called after this incarnation registered, so two
    such workers starting at once both see the other. The refused incarnation is marked
    stopped (it holds nothing yet), and the error ends the worker's start.
    """
    for other in rt.store.live_brokers(owner):
        theirs = BrokerIdentity.loads(other.broker)
        if theirs is None or mine.same_broker(theirs):
            continue
        rt.store.mark_stopped(owner, rt.config.submit_timeout)
        raise ConfigurationError(
            f"refusing to start: this store ({sanitize_url(rt.config.store_url)}, "
            f"resilient_table_prefix={rt.config.table_prefix!r}) is used by worker "
            f"{other.node} (lease renewed {other.renewed_ago:.0f}s ago) on broker "
            f"{theirs.shown}, and this worker's broker is {mine.shown}. Workers re-publish "
            "the store's work into their own broker, so two brokers sharing one store lose "
            "each other's work. Give each app its own resilient_table_prefix (or "
            "resilient_store_url), or point both at one broker; if both addresses reach the "
            "same broker, set resilient_broker_name to one name on every worker. A worker "
            "that was killed counts until its lease ends "
            f"(resilient_lease_seconds={rt.config.lease_seconds:g})."
        )
