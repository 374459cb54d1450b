"""Consumer bootstep: a lost broker connection lets go of the deliveries it carried.

When the connection to the broker drops, Celery forgets the messages it had received and
not yet handed to the pool (prefetched, or waiting for an ETA/countdown): a delivery tag
belongs to its channel, so they can be neither acked nor rejected, and the broker delivers
them again (RabbitMQ at once, Redis after its visibility timeout). Nothing acks or rejects
them here either, so without this step the worker would go on holding them: the heartbeat
would renew their reserved claims for as long as the worker lives, and a message stuck in
Redis's unacked set would wait out the whole visibility timeout (an hour by default) instead
of being re-published one lease later.

Celery's consumer runs ``on_close`` and then stops its steps, on the event loop's thread,
before it reconnects: this step's ``stop`` keeps only the ids Celery still knows.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import bootsteps
from celery.worker import state as worker_state

from celery_resilient.runtime.runtime import Runtime
from celery_resilient.worker import pool_drain
from celery_resilient.worker.dispatch import BatchedDispatch

log = logging.getLogger(__name__)


def known_task_ids() -> set[str]:
    """Task ids of every request Celery holds: executing, reserved, or waiting for an ETA."""
    ids = set(worker_state.requests)
    ids.update(r.id for r in list(worker_state.active_requests))
    ids.update(r.id for r in list(worker_state.reserved_requests))
    ids.update(r.id for r in list(worker_state.scheduled_requests))
    return ids


def known_task_ids_or_none() -> set[str] | None:
    """:func:`known_task_ids`, or None when Celery changed them while they were copied."""
    try:
        return known_task_ids()
    except RuntimeError:
        return None


def _shutting_down() -> bool:
    """Whether the worker is stopping (Celery sets these to an exit code, 0 included)."""
    return any(flag is not None and flag is not False
               for flag in (worker_state.should_stop, worker_state.should_terminate))


class ConnectionLossStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """On every stop of the consumer (a lost connection, or shutdown): drop held ids that
    Celery itself dropped, so their claims lapse and are re-published."""

    label = "celery-resilient connection"

    def start(self, consumer: Any) -> None:
        rt = Runtime.of(consumer.app)
        dispatcher = rt.dispatcher
        if isinstance(dispatcher, BatchedDispatch) and consumer.hub is not None:
            dispatcher.attach(consumer.hub, consumer)

    def stop(self, consumer: Any) -> None:
        rt = Runtime.of(consumer.app)
        # On Redis what the old connection fetched is still in this incarnation's holding:
        # the maintainer gives back what Celery forgot (HoldingSweep.reconcile_own).
        rt.broker_lost_at = time.time()
        # with the jobs the pool still holds: at a warm shutdown it drains jobs Celery's
        # close forgot (pool_drain.py), and their claims end with them
        known = known_task_ids() | pool_drain.pending_task_ids(getattr(consumer, "pool", None))
        if isinstance(rt.dispatcher, BatchedDispatch):
            rt.dispatcher.detach(known)
        dropped = rt.unacked.retain(known)
        if dropped and not _shutting_down():
            log.warning("broker connection closed: %d received message(s) Celery can no "
                        "longer acknowledge are let go; their claims are re-published once "
                        "their lease lapses", dropped, extra={"action": "deliveries_dropped",
                                                              "count": dropped})


__all__ = ["ConnectionLossStep", "known_task_ids", "known_task_ids_or_none"]
