"""The marker whose absence says a Redis broker lost its data: one per store, on real Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_resilient.broker.generation import BrokerMarker


@pytest.fixture
def channel(redis_url: str) -> Iterator[Any]:
    with Connection(redis_url) as conn:
        yield conn.default_channel


def _forget(redis_url: str, *markers: BrokerMarker) -> None:
    client = redis.Redis.from_url(redis_url)
    for m in markers:
        client.delete(f"resilient.generation.{m.suffix}")


def test_each_store_hears_of_a_loss_once_and_a_kept_broker_says_nothing(
        channel: Any, redis_url: str) -> None:
    mine, peer, other = (BrokerMarker("pg://a/test p_"), BrokerMarker("pg://a/test p_"),
                         BrokerMarker("pg://b/test p_"))
    try:
        assert mine.missing(channel) and not mine.lost_since_seen()  # its first look
        mine.mark(channel)
        assert not mine.missing(channel) and not peer.missing(channel)  # kept: nothing lost
        assert other.missing(channel), "another store's marker is its own"
        other.mark(channel)
        _forget(redis_url, mine, other)  # the broker loses its data
        assert mine.missing(channel) and mine.lost_since_seen()
        mine.mark(channel)
        assert not peer.missing(channel), "set again by a worker of its store: handled"
        assert other.missing(channel), "a store sharing the broker hears of it too"
    finally:
        _forget(redis_url, mine, other)


def test_other_brokers_have_no_marker() -> None:
    with Connection("memory://") as conn:
        assert not BrokerMarker("x").missing(conn.default_channel)
