"""The reliable fetch on a real Redis: what it holds, what kombu still does, and SIGKILLs of a
real consumer process in the middle of fetching (celery_resilient.broker)."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Queue

from celery_resilient.broker import holdings, keys
from celery_resilient.broker.transport import delivered_here
from celery_resilient.core import identity
from celery_resilient.testing import wait_for

RELIABLE = "celery_resilient.broker.transport:Transport"


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


def _publish(url: str, queue: Queue, bodies: list[Any], transport_options: dict[str, Any]
             | None = None, **properties: Any) -> None:
    with Connection(url, transport_options=transport_options or {}) as conn:
        producer = conn.Producer()
        for body in bodies:
            producer.publish(body, exchange=queue.exchange, routing_key=queue.routing_key,
                             declare=[queue], **properties)


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def queue(queue_name: str) -> Queue:
    return _queue(queue_name)


class Taking:
    """A consumer in this process that takes messages and keeps them unacknowledged."""

    def __init__(self, conn: Connection, queues: list[Queue], no_ack: bool = False) -> None:
        self.conn = conn
        self.got: list[tuple[Any, Any]] = []
        self.consumer = Consumer(conn, queues, callbacks=[self._on], no_ack=no_ack,
                                 prefetch_count=1000)

    def _on(self, body: Any, message: Any) -> None:
        self.got.append((body, message))

    def take(self, n: int, timeout: float = 10) -> list[tuple[Any, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.got) < n:
            assert time.monotonic() < deadline, f"got {len(self.got)} of {n} messages"
            with suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)
        return self.got


@contextmanager
def taking(url: str, queues: list[Queue], transport: str | None = RELIABLE,
           no_ack: bool = False, **options: Any) -> Iterator[Taking]:
    with Connection(url, transport=transport, transport_options=options) as conn:
        t = Taking(conn, queues, no_ack)
        with t.consumer:
            yield t


def _holding(r: redis.Redis, incarnation: str | None = None, prefix: str = "") -> set[str]:
    key = prefix + keys.holding(incarnation or identity.incarnation())
    return {t.decode() for t in r.smembers(key)}


def test_a_fetched_message_is_in_unacked_and_the_holding_until_acked(
        redis_url: str, r: redis.Redis, queue: Queue) -> None:
    _publish(redis_url, queue, [{"i": i} for i in range(3)])
    with taking(redis_url, [queue]) as t:
        got = t.take(3)
        tags = [m.delivery_tag for _, m in got]
        assert r.llen(queue.name) == 0
        assert _holding(r) >= set(tags)
        for tag in tags:
            payload, exchange, routing_key = json.loads(r.hget("unacked", tag))
            assert (exchange, routing_key) == (queue.exchange.name, queue.name)  # kombu's format
            assert payload["properties"]["delivery_tag"] == tag
            assert r.zscore("unacked_index", tag) is not None
        assert r.zscore(keys.HOLDERS, identity.incarnation()) is not None

        got[0][1].ack()
        assert not r.hexists("unacked", tags[0]) and tags[0] not in _holding(r)
        assert r.zscore("unacked_index", tags[0]) is None
        got[1][1].reject(requeue=True)
        assert not r.hexists("unacked", tags[1]) and tags[1] not in _holding(r)
        requeued = json.loads(r.lindex(queue.name, -1))
        assert _body(requeued) == got[1][0] and requeued["headers"]["redelivered"] is True
        # a new tag: a late ack of the given-back copy cannot touch the next holder's entry
        assert requeued["properties"]["delivery_tag"] not in tags
        assert tags[2] in _holding(r)
    # A clean close gives back what the channel still held, as kombu does.
    assert not r.hexists("unacked", tags[2]) and tags[2] not in _holding(r)
    assert r.llen(queue.name) == 2


def test_a_no_ack_consumer_holds_nothing(redis_url: str, r: redis.Redis, queue: Queue) -> None:
    _publish(redis_url, queue, ["a", "b"])
    with taking(redis_url, [queue], no_ack=True) as t:
        tags = [m.delivery_tag for _, m in t.take(2)]
        assert not any(r.hexists("unacked", tag) for tag in tags)
        assert not set(tags) & _holding(r)
    assert r.llen(queue.name) == 0  # nothing to give back: no_ack means taken for good


def test_order_over_queues_and_priorities_is_kombus(redis_url: str, queue_name: str) -> None:
    first, second = _queue(queue_name + "-a"), _queue(queue_name + "-b")

    def run(transport: str | None) -> list[str]:
        for p in (0, 9, 3, 6, 0):
            _publish(redis_url, first, [f"a{p}"], priority=p)
        _publish(redis_url, second, ["b1", "b2", "b3"])
        with taking(redis_url, [first, second], transport) as t:
            got = t.take(8)
            for _, message in got:
                message.ack()
            return [body for body, _ in got]

    assert run(RELIABLE) == run(None)


def test_an_idle_consumer_takes_what_arrives_on_any_queue(redis_url: str, queue_name: str,
                                                           r: redis.Redis) -> None:
    first, second = _queue(queue_name + "-a"), _queue(queue_name + "-b")
    with taking(redis_url, [first, second]) as t:
        with pytest.raises(AssertionError):
            t.take(1, timeout=0.5)  # idle: it waits, fetching nothing
        _publish(redis_url, second, ["late on the second queue"], priority=9)
        _publish(redis_url, first, ["late on the first queue"])
        bodies = sorted(body for body, _ in t.take(2))
    assert bodies == ["late on the first queue", "late on the second queue"]


def test_fetching_goes_on_after_the_server_forgets_its_scripts(
        redis_url: str, r: redis.Redis, queue: Queue) -> None:
    with taking(redis_url, [queue]) as t:
        _publish(redis_url, queue, ["before"])
        t.take(1)
        r.script_flush()  # as a Redis restart does
        _publish(redis_url, queue, ["after"])
        got = t.take(2)
        assert got[1][1].delivery_tag in _holding(r)


def test_a_global_key_prefix_applies_to_every_key(redis_url: str, r: redis.Redis,
                                                  queue: Queue) -> None:
    options = {"global_keyprefix": "pfx:"}
    _publish(redis_url, queue, ["x"], transport_options=options)
    with taking(redis_url, [queue], **options) as t:
        (_, message), = t.take(1)
        tag = message.delivery_tag
        assert r.hexists("pfx:unacked", tag) and tag in _holding(r, prefix="pfx:")
        assert r.zscore("pfx:" + keys.HOLDERS, identity.incarnation()) is not None
        message.ack()
        assert not r.hexists("pfx:unacked", tag) and not _holding(r, prefix="pfx:")


def test_basic_get_holds_unless_no_ack(redis_url: str, r: redis.Redis, queue: Queue) -> None:
    _publish(redis_url, queue, ["one", "two"])
    with Connection(redis_url, transport=RELIABLE) as conn:
        channel = conn.default_channel
        message = channel.basic_get(queue.name)
        assert message.delivery_tag in _holding(r) and r.hexists("unacked", message.delivery_tag)
        message.ack()
        assert message.delivery_tag not in _holding(r)
        unheld = channel.basic_get(queue.name, no_ack=True)
        assert unheld is not None and not r.hexists("unacked", unheld.delivery_tag)


def _start_consumer(url: str, queue: Queue, transport: str = "reliable",
                    done_log: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    """A consumer process that holds what it takes, or records and acks it (``done_log``)."""
    extra = [str(done_log)] if done_log is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.fetch_consumer", url,
                             queue.name, transport, *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("incarnation "), line
    return proc, line.split()[1]


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGKILL: no clean exit, nothing given back by the consumer itself."""
    proc.kill()
    proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


def _wait_got(proc: subprocess.Popen[str], n: int = 1) -> None:
    assert proc.stdout is not None
    for _ in range(n):
        assert proc.stdout.readline().startswith("got "), "the consumer stopped"


def test_kombus_visibility_restore_skips_what_a_live_holder_holds(
        redis_url: str, r: redis.Redis, queue_name: str) -> None:
    by_other, by_plain, here = (_queue(f"{queue_name}-{n}") for n in ("other", "plain", "here"))
    _publish(redis_url, by_other, ["held by a live worker"])
    _publish(redis_url, by_plain, ["taken by plain kombu"])
    _publish(redis_url, here, ["held here"])
    other, other_incarnation = _start_consumer(redis_url, by_other)
    plain, _ = _start_consumer(redis_url, by_plain, "kombu")
    try:
        _wait_got(other)
        _wait_got(plain)
        plain.kill()  # plain kombu's consumer dies: its message sits in unacked, unheld
        plain.wait()
        with taking(redis_url, [here], visibility_timeout=1) as t:
            (_, mine), = t.take(1)
            assert mine.delivery_tag in delivered_here()
            other_tags = _holding(r, other_incarnation)
            assert len(other_tags) == 1
            wait_for(lambda: all(
                time.time() - float(r.zscore("unacked_index", tag) or time.time()) > 1.2
                for tag in [*other_tags, mine.delivery_tag]), 10, "the visibility timeout")
            t.conn.default_channel.qos.restore_visible(num=None, interval=1)
            assert r.llen(by_plain.name) == 1, "an old message nobody holds went back"
            assert r.llen(by_other.name) == 0 and r.hexists("unacked", other_tags.pop())
            assert r.llen(here.name) == 0 and r.hexists("unacked", mine.delivery_tag)
            mine.ack()
    finally:
        for proc in (other, plain):
            _stop(proc)
    # what the dead holder held goes back when the sweep (here: by hand) restores it
    with Connection(redis_url, transport=RELIABLE) as conn:
        back = holdings.restore(conn.default_channel, other_incarnation)
    assert [h.task_id for h in back] == [None] and r.llen(by_other.name) == 1
    assert r.zscore(keys.HOLDERS, other_incarnation) is None


def test_sigkill_at_any_moment_of_fetching_loses_nothing(
        redis_url: str, r: redis.Redis, queue: Queue, tmp_path: Path) -> None:
    """A real consumer process, fetching and acknowledging as fast as it can, is SIGKILLed
    25 times at random moments (at least 10: a fast machine may empty the queue first);
    after each kill its holding is given back (what the sweep does). Every message is then
    in its queue or done (both, if the kill fell between the done record and the ack), none
    in ``unacked``, and each one given back is in its queue marked redelivered under a new
    delivery tag. (benchmarks/fetch_kills.py runs the same
    kills on kombu's own fetch: about one kill in three loses a message there.)"""
    total = 40_000
    _publish(redis_url, queue, list(range(total)))
    done_log = tmp_path / "done"
    rng = random.Random(20)
    restored = kills = 0
    for _ in range(25):
        if not r.llen(queue.name):
            break  # a fast machine consumed them all: a consumer would wait for ever
        proc, incarnation = _start_consumer(redis_url, queue, done_log=done_log)
        kills += 1
        _wait_got(proc)
        time.sleep(rng.uniform(0, 0.3))  # the kill lands wherever the fetch loop is
        _stop(proc)
        with Connection(redis_url, transport=RELIABLE) as conn:
            held = holdings.held(conn.default_channel, incarnation)
            bodies = {h.tag: _body(json.loads(r.hget("unacked", h.tag) or b"null")[0])
                      for h in held if h.present}
            back = holdings.restore(conn.default_channel, incarnation)
        assert len(back) == len(held) and all(h.present for h in held)
        restored += len(back)
        assert not _holding(r, incarnation) and not any(
            r.hexists("unacked", h.tag) for h in back)
        payloads = [json.loads(m) for m in r.lrange(queue.name, 0, -1)]
        again = {_body(p): p["properties"]["delivery_tag"] for p in payloads
                 if p["headers"].get("redelivered")}
        for tag, body in bodies.items():
            assert body in again, f"message {body} given back is not marked redelivered"
            assert again[body] != tag, f"message {body} came back under its old tag"
        queued = {_body(p) for p in payloads}
        done = {int(line) for line in done_log.read_text().split()}
        missing = set(range(total)) - queued - done
        assert not missing, f"{len(missing)} message(s) lost: {sorted(missing)[:5]}"
        assert len(queued) == len(payloads), "a message is in its queue twice"
    assert restored, "the kills should land while the consumer holds messages"
    assert kills >= 10, f"only {kills} kills before the queue ran dry"


def _body(payload: dict[str, Any]) -> Any:
    body = payload["body"]
    if payload["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body).decode()
    return json.loads(body)


def test_a_restored_holding_goes_to_the_front_of_its_queue(
        redis_url: str, r: redis.Redis, queue: Queue) -> None:
    _publish(redis_url, queue, [f"m{i}" for i in range(6)])
    proc, incarnation = _start_consumer(redis_url, queue)
    _wait_got(proc, 6)
    _stop(proc)
    _publish(redis_url, queue, ["later"])
    with Connection(redis_url, transport=RELIABLE) as conn:
        assert len(holdings.restore(conn.default_channel, incarnation)) == 6
    with taking(redis_url, [queue]) as t:
        got = t.take(7)
        for _, message in got:
            message.ack()
    bodies = [body for body, _ in got]
    assert sorted(bodies[:6]) == [f"m{i}" for i in range(6)] and bodies[6] == "later"
    assert all(m.delivery_info.get("redelivered") or m.headers.get("redelivered")
               for _, m in got[:6])


def test_unknown_holders_keep_kombus_rule(redis_url: str, r: redis.Redis,
                                          queue: Queue) -> None:
    """A holding nobody's store knows goes back only past the visibility timeout."""
    _publish(redis_url, queue, ["x"])
    proc, incarnation = _start_consumer(redis_url, queue)
    _wait_got(proc)
    _stop(proc)
    with Connection(redis_url, transport=RELIABLE,
                    transport_options={"visibility_timeout": 3600}) as conn:
        channel = conn.default_channel
        assert holdings.restore(channel, incarnation,
                                older_than=holdings.visibility_ceiling(channel)) == []
        assert r.llen(queue.name) == 0
        assert len(holdings.restore(channel, incarnation, older_than=time.time() + 1)) == 1
    assert r.llen(queue.name) == 1

