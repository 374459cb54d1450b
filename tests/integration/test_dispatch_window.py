"""The prefetch window while acknowledgements wait for the dispatcher's flush.

A finished request whose ack waits for the flush (worker/dispatch/) holds a prefetch slot
but no pool process; the consumer's window widens by one until the ack, as Celery widens it
for a request waiting for its ETA, so the flush's latency does not narrow the window the pool
draws from (its effect on throughput: docs/performance.md, "The batched hot path").

PostgreSQL only: on SQLite the finish waits for its own commit and no ack is deferred.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kombu.common import QoS

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.sql import Store
from celery_resilient.worker.dispatch import BatchedDispatch

pytestmark = pytest.mark.postgres
WINDOW = 8


class Hub:
    """The consumer's event loop, as far as the dispatcher uses it: readers on fds."""

    def __init__(self) -> None:
        self.readers: dict[int, Callable[..., None]] = {}

    def add_reader(self, fd: int, callback: Callable[..., None]) -> None:
        self.readers[fd] = callback

    def remove_reader(self, fd: int) -> None:
        self.readers.pop(fd, None)

    def run_once(self, timeout: float = 10.0) -> None:
        """Wait for a reader's fd to be readable and call it (one loop iteration)."""
        ready, _, _ = select.select(list(self.readers), [], [], timeout)
        assert ready, "the dispatcher never woke the event loop"
        for fd in ready:
            self.readers[fd]()


class FinishedRequest:
    def __init__(self, task_id: str) -> None:
        self.id = task_id
        self.acked = 0

    def acknowledge_now(self) -> None:
        self.acked += 1


@pytest.fixture
def dispatcher(pg_store: Store) -> Iterator[BatchedDispatch]:
    d = BatchedDispatch(SimpleNamespace(store=pg_store, config=ResilientConfig()),  # type: ignore[arg-type]
                        Owner("window@test", "incarnation", os.getpid()))
    d.start()
    yield d
    d.stop()


def _consumer() -> Any:
    applied: list[int] = []
    qos = QoS(lambda prefetch_count: applied.append(prefetch_count),  # noqa: PLW0108 - by keyword
              WINDOW)  # type: ignore[no-untyped-call]
    return SimpleNamespace(qos=qos, applied=applied)


def _handed(d: BatchedDispatch, request: FinishedRequest) -> None:
    """As if the batched take had handed ``request`` its claim (what makes its ack wait)."""
    d._claims[request] = (f"key-{request.id}", 1)


def test_a_request_waiting_for_its_flush_frees_its_prefetch_slot_until_acked(
        dispatcher: BatchedDispatch) -> None:
    hub, consumer = Hub(), _consumer()
    dispatcher.attach(hub, consumer)
    requests = [FinishedRequest(f"t{i}") for i in range(3)]
    for r in requests:
        _handed(dispatcher, r)
        assert dispatcher.defer_ack(r), "a handed claim's ack waits for the flush"
    assert consumer.qos.value == WINDOW + 3
    consumer.qos.update()
    assert consumer.applied[-1] == WINDOW + 3, "the broker channel was given the wider window"
    while any(r.acked == 0 for r in requests):
        hub.run_once()
    assert [r.acked for r in requests] == [1, 1, 1]
    assert consumer.qos.value == WINDOW, "each ack narrows the window back"
    consumer.qos.update()
    assert consumer.applied[-1] == WINDOW


def test_a_lost_connection_leaves_the_next_connections_window_alone(
        dispatcher: BatchedDispatch) -> None:
    hub, old = Hub(), _consumer()
    dispatcher.attach(hub, old)
    request = FinishedRequest("lost")
    _handed(dispatcher, request)
    assert dispatcher.defer_ack(request)
    dispatcher.detach(known=None)  # the connection drops before the flush reached the loop
    new = _consumer()  # Celery makes a new window for the new connection
    dispatcher.attach(hub, new)
    other = FinishedRequest("next")
    _handed(dispatcher, other)
    assert dispatcher.defer_ack(other)
    while other.acked == 0:
        hub.run_once()
    assert request.acked == 0, "its delivery tag died with the old connection"
    assert new.qos.value == WINDOW, "only the new connection's own ack narrowed it"


def test_a_warm_shutdown_acknowledges_what_waits_for_the_flush(pg_store: Store) -> None:
    """Celery stops the worker's steps after its event loop ended: results waiting for the
    flush are flushed and acknowledged by the stop, not left for a redelivery."""
    d = BatchedDispatch(SimpleNamespace(store=pg_store, config=ResilientConfig()),  # type: ignore[arg-type]
                        Owner("window@test", "incarnation", os.getpid()))
    d.start()
    hub, consumer = Hub(), _consumer()
    d.attach(hub, consumer)
    requests = [FinishedRequest(f"s{i}") for i in range(2)]
    for r in requests:
        _handed(d, r)
        assert d.defer_ack(r)
    d.stop()  # the loop never ran again
    assert [r.acked for r in requests] == [1, 1]
    assert consumer.qos.value == WINDOW
    late = FinishedRequest("late")
    _handed(d, late)
    assert not d.defer_ack(late), "after the stop the caller flushes and acknowledges itself"


class Backlogged(BatchedDispatch):
    """Every batch of takes writes (its commit waits for the WAL flush, ~5 ms here) and
    finds another delivery waiting: a worker draining a backlog."""

    def __init__(self, *args: Any, batches: int) -> None:
        super().__init__(*args)
        self.batches_left = batches

    def _take_batch(self) -> bool:
        entry = self._waiting.popleft()
        time.sleep(0.005)  # the batch's commit (the thing measured is what happens after it)
        if self.batches_left > 0:
            self.batches_left -= 1
            self._waiting.append(entry)
        return True


def test_a_backlog_does_not_hold_acknowledgements_back(pg_store: Store) -> None:
    """A batch that wrote covers the acks asked for before it: they go to the event loop
    after that batch, not when the backlog ends (the review's worker held 509 finished
    requests unacknowledged, the prefetch window widened to match)."""
    d = Backlogged(SimpleNamespace(store=pg_store, config=ResilientConfig()),
                   Owner("window@test", "incarnation", os.getpid()), batches=1000)
    d.start()
    try:
        hub, consumer = Hub(), _consumer()
        d.attach(hub, consumer)
        finished = FinishedRequest("done-early")
        _handed(d, finished)
        assert d.defer_ack(finished)
        d.submit(FinishedRequest("backlog"), lambda request: None)
        hub.run_once()
        assert finished.acked == 1
        assert d.batches_left > 900, "acknowledged only when the backlog ended"
        assert consumer.qos.value == WINDOW
    finally:
        d.batches_left = 0
        d.stop()
