"""Main-process hooks that put work into the store before it can be lost.

``task_received``: every delivery of a resumable task (running and prefetched alike) is
recorded as reserved by this worker incarnation, with its message, so that if the worker
dies the message can be re-published in seconds instead of waiting for the broker.

``ResumableTask.apply_async`` (opt-in ``resilient_durable_submit``): the work and a
re-publishable message are in the store before the broker sees it, which survives a broker
that loses its data.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

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


class HeldRequests:
    """Task ids of the resumable messages this worker holds (received, not yet acked).

    A count per id: a retry or a store-outage re-send reuses the task id, and the copy may be
    received before the original is acknowledged. The heartbeat renews only claims whose
    message is still held here; any other claim of this worker (its message was acked or
    rejected without ending the work) lapses and the sweeper re-publishes it.
    """

    #: Above this many held ids the heartbeat renews every claim (one IN list stays small).
    MAX_FILTER = 10_000

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, task_id: str) -> None:
        with self._lock:
            self._counts[task_id] = self._counts.get(task_id, 0) + 1

    def release(self, task_id: str) -> None:
        with self._lock:
            left = self._counts.get(task_id, 0) - 1
            if left > 0:
                self._counts[task_id] = left
            else:
                self._counts.pop(task_id, None)

    def snapshot(self) -> frozenset[str] | None:
        """The held ids, or None when there are too many to filter by."""
        with self._lock:
            if len(self._counts) > self.MAX_FILTER:
                return None
            return frozenset(self._counts)


def record_received(rt: Resilient, request: Any) -> None:
    from .task import ResumableTask

    task = request.task
    if not isinstance(task, ResumableTask):
        return
    rt.held.add(request.id)
    msg = request.message
    try:
        key = workkey.derive(task, request.id, request.args, request.kwargs, msg.headers)
        rt.receipts.add(Receipt(key, request.name, request.id,
                                _digest(request.args, request.kwargs),
                                messages.from_kombu(msg)))
    except ResilientError as exc:
        log.error("could not record receipt of %s: %s", request.id, exc,
                  extra={"action": "receipt_failed", "task_id": request.id})


# Options of apply_async that are live objects, not part of the message.
_LOCAL_OPTIONS = ("producer", "connection", "router", "publisher", "add_to_parent")


def record_submission(rt: Resilient, task: Any, args: Any, kwargs: Any, task_id: str,
                      options: dict[str, Any]) -> None:
    """Durable submit: the work is in the store before the broker sees its message.

    Raises :class:`StoreUnavailable` to the caller of ``apply_async`` when the store is down,
    before anything is published, so a submission is never silently without its record.
    """
    kept = {k: v for k, v in options.items() if k not in _LOCAL_OPTIONS}
    signature = task.signature(args, kwargs, {**kept, "task_id": task_id})
    message = messages.from_signature(signature)
    if message is None:
        raise ResilientError(
            f"durable submit of {task.name}: arguments and options must be JSON to be kept "
            "in the store; send JSON arguments or disable resilient_durable_submit"
        )
    headers = options.get("headers") or {}
    key = workkey.derive(task, task_id, args, kwargs, headers)
    rt.store.record_submission(key, task.name, task_id, _digest(args, kwargs), message,
                               rt.config.submit_timeout)


def _digest(args: Any, kwargs: Any) -> str | None:
    try:
        return codec.digest([list(args or ()), dict(kwargs or {})])
    except ResilientError:
        return None
