"""Deliveries waiting to be recorded, and the ids of requests this worker still holds.

Both are filled on the consumer's event loop (``celery_resilient.worker.receiving``) and
drained by the maintainer thread, so the store is never on the path of message consumption.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable

from celery_resilient.store.sql import Receipt

log = logging.getLogger(__name__)
MAX_PENDING = 100_000


class ReceiptBuffer:
    """Deliveries waiting to be written, flushed in batches by the worker's maintainer thread.

    The broker's event loop only appends here; one multi-row statement per flush keeps the
    store off the path of message consumption. The broker still holds every message unacked
    until its task finishes, so a receipt lost with the process costs speed, not work.

    Bounded by count (``max_items``) and by bytes (``max_bytes``: the stored messages, see
    :meth:`size_of`), so a store outage under heavy traffic cannot grow the worker's memory
    without limit: when full, the oldest receipts are dropped with a warning. The worker sets
    ``max_bytes`` from ``resilient_receipt_buffer_bytes``.
    """

    #: The default of ``resilient_receipt_buffer_bytes`` (64 MiB).
    DEFAULT_MAX_BYTES = 64 * 1024 * 1024

    def __init__(self, max_items: int = MAX_PENDING,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._items: deque[Receipt] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.arrived = threading.Event()
        self.max_items = max_items
        self.max_bytes = max_bytes

    @staticmethod
    def size_of(receipt: Receipt) -> int:
        """Bytes a receipt holds: its stored message (body, headers, routing), ASCII JSON."""
        return len(receipt.message_json or "")

    def add(self, receipt: Receipt) -> None:
        size = self.size_of(receipt)
        with self._lock:
            if size > self.max_bytes:
                self._drop(receipt, "smaller than this one message")
            else:
                self._items.append(receipt)
                self._bytes += size
                self._trim()
        self.arrived.set()

    def take_all(self) -> list[Receipt]:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._bytes = 0
            self.arrived.clear()
        return items

    def put_back(self, items: list[Receipt]) -> None:
        with self._lock:
            self._items.extendleft(reversed(items))
            self._bytes += sum(self.size_of(r) for r in items)
            self._trim()
        self.arrived.set()

    @property
    def nbytes(self) -> int:
        """The bytes buffered now (the sum of :meth:`size_of` over the receipts)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def _trim(self) -> None:
        """Drop the oldest receipts until both bounds hold (the lock is held)."""
        while self._items and (len(self._items) > self.max_items
                               or self._bytes > self.max_bytes):
            dropped = self._items.popleft()
            self._bytes -= self.size_of(dropped)
            self._drop(dropped, "full")

    @staticmethod
    def _drop(receipt: Receipt, why: str) -> None:
        log.warning("receipt buffer %s; dropped receipt of %s", why, receipt.work_key,
                    extra={"action": "receipt_dropped", "work_key": receipt.work_key})


class UnackedDeliveries:
    """Task ids of the resumable messages this worker holds (received, not yet acked).

    A count per id: a retry or a store-outage re-send reuses the task id, and the copy may be
    received before the original is acknowledged. Before each sweep the worker lets go of
    its reserved claims whose message is no longer held here (acked or rejected without
    ending the work), and the sweeper re-publishes them (``Store.reconcile``).
    """

    #: Above this many held ids no reserved claim is judged by them (a bounded snapshot).
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

    def retain(self, task_ids: Iterable[str]) -> int:
        """Let go of every id not in ``task_ids``; return how many were let go.

        For a broker connection that dropped: Celery forgets the deliveries it can no
        longer acknowledge without acking or rejecting them, so nothing releases them here.
        """
        keep = set(task_ids)
        with self._lock:
            gone = [t for t in self._counts if t not in keep]
            for t in gone:
                del self._counts[t]
        return len(gone)

    def among(self, task_ids: Iterable[str]) -> set[str]:
        """Those of ``task_ids`` unacknowledged here now (no copy of the whole set)."""
        with self._lock:
            return {t for t in task_ids if t in self._counts}

    def snapshot(self) -> frozenset[str] | None:
        """The held ids, or None when there are too many to filter by."""
        with self._lock:
            if len(self._counts) > self.MAX_FILTER:
                return None
            return frozenset(self._counts)
