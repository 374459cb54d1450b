"""Main-process hooks that put work into the store before it can be lost.

``task_received``: every delivery of a resumable task (running and prefetched alike) is
recorded as reserved by this worker incarnation, with its message, so that if the worker
dies the message can be re-published in seconds instead of waiting for the broker.

``before_task_publish`` (opt-in ``resilient_durable_submit``): the message is in the store
before the broker sees it, which survives a broker that loses its data.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kombu.serialization import dumps as kombu_dumps

from . import codec, identity, messages, workkey
from .errors import ResilientError, StoreUnavailable

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)


def record_received(rt: Resilient, request: Any) -> None:
    from .task import ResumableTask

    task = request.task
    if not isinstance(task, ResumableTask):
        return
    msg = request.message
    try:
        key = workkey.derive(task, request.id, request.args, request.kwargs, msg.headers)
        digest = _digest(request.args, request.kwargs)
        rt.store.record_receipt(
            key, request.name, request.id, digest, messages.from_kombu(msg),
            identity.owner(request.hostname), rt.config.lease_seconds,
        )
    except StoreUnavailable as exc:
        # The message is still unacked at the broker; the pool process will retry the store.
        log.warning("could not record receipt of %s: %s", request.id, exc,
                    extra={"action": "receipt_failed", "task_id": request.id})
    except ResilientError as exc:
        log.error("could not record receipt of %s: %s", request.id, exc,
                  extra={"action": "receipt_failed", "task_id": request.id})


def record_submitted(rt: Resilient, body: Any, headers: dict[str, Any],
                     properties: dict[str, Any], exchange: str, routing_key: str) -> None:
    """Durable submit: store the message (serialized as it will be sent) before publishing."""
    from .task import ResumableTask

    name = headers.get("task")
    task = rt.app.tasks.get(name) if name else None
    if not isinstance(task, ResumableTask) or not isinstance(name, str):
        return
    args, kwargs = (body[0], body[1]) if isinstance(body, (list, tuple)) else ((), {})
    key = workkey.derive(task, headers["id"], args, kwargs, headers)
    serializer = task.serializer or rt.app.conf.task_serializer
    content_type, content_encoding, data = kombu_dumps(  # type: ignore[no-untyped-call]
        body, serializer=serializer)
    rt.store.record_submission(
        key, name, headers["id"], _digest(args, kwargs),
        messages.from_publish(data, content_type, content_encoding, headers, properties,
                              exchange, routing_key),
        rt.config.submit_timeout,
    )


def _digest(args: Any, kwargs: Any) -> str | None:
    try:
        return codec.digest([list(args or ()), dict(kwargs or {})])
    except ResilientError:
        return None
