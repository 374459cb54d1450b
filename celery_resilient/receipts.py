"""Main-process hooks that put work into the store before it can be lost.

``task_received``: every delivery of a resumable task (running and prefetched alike) is
recorded as reserved by this worker incarnation, with its message, so that if the worker
dies the message can be re-published in seconds instead of waiting for the broker.

``before_task_publish`` (opt-in ``resilient_durable_submit``): the message is in the store
before the broker sees it, which survives a broker that loses its data.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from kombu.serialization import dumps as kombu_dumps

from . import codec, messages, workkey
from .errors import ResilientError
from .store.sql import Receipt

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)
MAX_PENDING = 100_000


class ReceiptBuffer:
    """Deliveries waiting to be written, flushed in batches by the worker's maintainer thread.

    The broker's event loop only appends here; one multi-row statement per flush keeps the
    store off the path of message consumption. The broker still holds every message unacked
    until its task finishes, so a receipt lost with the process costs speed, not work.
    """

    def __init__(self) -> None:
        self._items: deque[Receipt] = deque()
        self._lock = threading.Lock()
        self.arrived = threading.Event()

    def add(self, receipt: Receipt) -> None:
        with self._lock:
            if len(self._items) >= MAX_PENDING:
                dropped = self._items.popleft()
                log.warning("receipt buffer full; dropped receipt of %s", dropped.work_key,
                            extra={"action": "receipt_dropped", "work_key": dropped.work_key})
            self._items.append(receipt)
        self.arrived.set()

    def take_all(self) -> list[Receipt]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self.arrived.clear()
        return items

    def put_back(self, items: list[Receipt]) -> None:
        with self._lock:
            self._items.extendleft(reversed(items))
        self.arrived.set()

    def __len__(self) -> int:
        return len(self._items)


def record_received(rt: Resilient, request: Any) -> None:
    from .task import ResumableTask

    task = request.task
    if not isinstance(task, ResumableTask):
        return
    msg = request.message
    try:
        key = workkey.derive(task, request.id, request.args, request.kwargs, msg.headers)
        rt.receipts.add(Receipt(key, request.name, request.id,
                                _digest(request.args, request.kwargs),
                                messages.from_kombu(msg)))
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
