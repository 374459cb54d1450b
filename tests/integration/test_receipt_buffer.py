"""The main process's receipt buffer is bounded by bytes as well as by count.

The receipts are built from real task messages: sent through Redis by a Celery app, received
with kombu and encoded by ``messages.from_kombu``, as the worker's ``task_received`` hook does.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_resilient.core import messages
from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.runtime.receipts import MAX_PENDING, ReceiptBuffer
from celery_resilient.store.sql import Receipt

SMALL = 1_000  # characters of the task's argument
LARGE = 40_000


@pytest.fixture
def real_receipts(redis_url: str, queue_name: str) -> Iterator[list[Receipt]]:
    """30 receipts of real Redis deliveries: 20 with a small argument, then 10 with a large."""
    app = Celery("receipt-sizes", broker=redis_url, set_as_current=False)
    sizes = [SMALL] * 20 + [LARGE] * 10
    ids = [f"rb-{i}-{uuid.uuid4().hex[:8]}" for i in range(len(sizes))]
    for task_id, size in zip(ids, sizes, strict=True):
        app.send_task("proj.ingest", args=["x" * size], task_id=task_id, queue=queue_name)
    received: list[Receipt] = []
    with app.connection_for_read() as conn:
        inbox = conn.SimpleQueue(app.amqp.queues[queue_name])
        try:
            for _ in ids:
                msg = inbox.get(timeout=10)
                received.append(Receipt(f"key-{msg.headers['id']}", msg.headers["task"],
                                        msg.headers["id"], None, messages.from_kombu(msg)))
                msg.ack()
        finally:
            inbox.queue.delete()
            inbox.close()
    app.close()
    assert [r.task_id for r in received] == ids, "Redis delivered the messages out of order"
    yield received


def _dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "work_key", "") for r in caplog.records
            if getattr(r, "action", None) == "receipt_dropped"]


def test_sizes_are_those_of_the_stored_messages(real_receipts: list[Receipt]) -> None:
    buffer = ReceiptBuffer()
    for receipt in real_receipts:
        assert receipt.message_json is not None
        assert buffer.size_of(receipt) == len(receipt.message_json.encode("utf-8"))
    small, large = buffer.size_of(real_receipts[0]), buffer.size_of(real_receipts[-1])
    assert SMALL < small < SMALL + 2_000 and LARGE < large < LARGE + 2_000
    for receipt in real_receipts:
        buffer.add(receipt)
    assert len(buffer) == 30
    assert buffer.nbytes == sum(buffer.size_of(r) for r in real_receipts)
    assert buffer.take_all() == real_receipts and buffer.nbytes == 0 and len(buffer) == 0


def test_byte_bound_drops_the_oldest_with_a_warning(real_receipts: list[Receipt],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    size = ReceiptBuffer.size_of
    limit = sum(size(r) for r in real_receipts[-3:]) + size(real_receipts[-4]) // 2
    buffer = ReceiptBuffer(max_bytes=limit)
    with caplog.at_level(logging.WARNING, logger="celery_resilient.runtime.receipts"):
        for receipt in real_receipts:
            buffer.add(receipt)
            assert buffer.nbytes <= limit
    # Far fewer than the count bound: only the newest three large messages fit.
    assert buffer.take_all() == real_receipts[-3:]
    assert _dropped(caplog) == [r.work_key for r in real_receipts[:-3]]
    assert buffer.nbytes == 0


def test_count_bound_still_holds(real_receipts: list[Receipt]) -> None:
    buffer = ReceiptBuffer(max_items=5)
    for receipt in real_receipts[:20]:
        buffer.add(receipt)
    assert len(buffer) == 5 and buffer.nbytes == sum(map(buffer.size_of, real_receipts[15:20]))
    assert buffer.take_all() == real_receipts[15:20]
    assert ReceiptBuffer().max_items == MAX_PENDING


def test_put_back_keeps_order_and_the_bound(real_receipts: list[Receipt],
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A failed flush puts its batch back in front; receipts that arrived meanwhile win."""
    small = real_receipts[:20]
    limit = sum(map(ReceiptBuffer.size_of, small[2:14]))  # exactly the newest twelve
    buffer = ReceiptBuffer(max_bytes=limit)
    for receipt in small[:10]:
        buffer.add(receipt)
    batch = buffer.take_all()  # the maintainer's flush, which then fails
    for receipt in small[10:14]:
        buffer.add(receipt)  # deliveries during the failed flush
    with caplog.at_level(logging.WARNING, logger="celery_resilient.runtime.receipts"):
        buffer.put_back(batch)
    kept = buffer.take_all()
    assert kept == small[2:14], "the oldest two of the put-back batch must go"
    assert _dropped(caplog) == [r.work_key for r in small[:2]]
    assert sum(map(ReceiptBuffer.size_of, kept)) <= limit


def test_a_receipt_larger_than_the_buffer_is_dropped_alone(
        real_receipts: list[Receipt], caplog: pytest.LogCaptureFixture) -> None:
    small, large = real_receipts[0], real_receipts[-1]
    buffer = ReceiptBuffer(max_bytes=ReceiptBuffer.size_of(large) - 1)
    buffer.add(small)
    with caplog.at_level(logging.WARNING, logger="celery_resilient.runtime.receipts"):
        buffer.add(large)
    assert buffer.take_all() == [small]
    assert _dropped(caplog) == [large.work_key]


def test_setting_default_and_validation() -> None:
    assert ResilientConfig().receipt_buffer_bytes == ReceiptBuffer.DEFAULT_MAX_BYTES
    assert ReceiptBuffer().max_bytes == 64 * 1024 * 1024
    conf = ResilientConfig.from_mapping({"resilient_store_url": "sqlite:///x.db",
                                         "resilient_receipt_buffer_bytes": "1048576"})
    assert conf.receipt_buffer_bytes == 1_048_576
    with pytest.raises(ConfigurationError, match="resilient_receipt_buffer_bytes"):
        ResilientConfig.from_mapping({"resilient_store_url": "sqlite:///x.db",
                                      "resilient_receipt_buffer_bytes": 0})
