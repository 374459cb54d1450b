"""A gone worker's holding goes back to its queue in the order it was fetched, on a real
Redis: the next fetch takes first what the dead worker took first, which is the work it had
started (every pool starts requests in delivery order), then what it had only prefetched,
then the queue's backlog (celery_resilient.broker.holdings.restore_order)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue

from celery_resilient.broker import holdings

RELIABLE = "celery_resilient.broker.transport:Transport"
COUNT = 40


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def queue(queue_name: str) -> Queue:
    return Queue(queue_name, Exchange(queue_name, type="direct"), routing_key=queue_name)


def _publish(url: str, queue: Queue, bodies: list[str]) -> None:
    with Connection(url) as conn:
        producer = conn.Producer()
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue])


def _held_by_a_killed_consumer(url: str, queue: Queue, count: int) -> str:
    """A consumer process (the reliable fetch) takes ``count`` messages and is SIGKILLed
    holding them all; returns its incarnation."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.fetch_consumer", url,
                             queue.name, "reliable"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("incarnation "), line
        for _ in range(count):
            assert proc.stdout.readline().startswith("got "), "the consumer stopped"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return line.split()[1]


def _drain(url: str, queue: Queue, count: int) -> list[Any]:
    got: list[tuple[Any, Any]] = []
    with Connection(url, transport=RELIABLE) as conn, Consumer(
            conn, [queue], callbacks=[lambda body, m: got.append((body, m))],
            prefetch_count=1000):
        deadline = time.monotonic() + 10
        while len(got) < count:
            assert time.monotonic() < deadline, f"got {len(got)} of {count}"
            with suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
        for _, message in got:
            message.ack()
    return [body for body, _ in got]


def test_a_holding_goes_back_in_fetch_order_ahead_of_the_backlog(
        redis_url: str, r: redis.Redis, queue: Queue) -> None:
    sent = [f"m{i:02d}" for i in range(COUNT)]
    _publish(redis_url, queue, sent)
    incarnation = _held_by_a_killed_consumer(redis_url, queue, COUNT)
    _publish(redis_url, queue, ["backlog-0", "backlog-1"])
    with Connection(redis_url, transport=RELIABLE) as conn:
        channel = conn.default_channel
        fetched = sorted(holdings.held(channel, incarnation), key=lambda h: h.fetched_at or 0)
        back = holdings.restore(channel, incarnation)
    assert len(back) == COUNT and len({h.fetched_at for h in fetched}) == COUNT
    # the order the consumer fetched them in is the order they come back in
    assert _drain(redis_url, queue, COUNT + 2) == [*sent, "backlog-0", "backlog-1"]


def test_part_of_a_holding_goes_back_in_fetch_order_too(
        redis_url: str, r: redis.Redis, queue: Queue) -> None:
    """A sweep that gives back only some (``tags``: what a worker forgot after a lost
    connection; ``only``: resumable work of an unproven holder) keeps the same order."""
    sent = [f"m{i:02d}" for i in range(12)]
    _publish(redis_url, queue, sent)
    incarnation = _held_by_a_killed_consumer(redis_url, queue, 12)
    with Connection(redis_url, transport=RELIABLE) as conn:
        channel = conn.default_channel
        by_time = sorted(holdings.held(channel, incarnation), key=lambda h: h.fetched_at or 0)
        odd = [h.tag for i, h in enumerate(by_time) if i % 2]
        holdings.restore(channel, incarnation, tags=odd)
        assert _drain(redis_url, queue, 6) == sent[1::2]
        holdings.restore(channel, incarnation, only=lambda h: True)
    assert _drain(redis_url, queue, 6) == sent[0::2]
    assert r.llen(queue.name) == 0
