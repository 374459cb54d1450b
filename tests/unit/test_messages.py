"""messages: a stored broker message re-publishes byte for byte (kombu's in-memory transport)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue
from kombu.message import Message

from celery_resilient import messages


@pytest.fixture
def conn() -> Iterator[Connection]:
    with Connection(f"memory://{uuid.uuid4().hex}") as c:
        yield c


def _queue(conn: Connection) -> Queue:
    q = Queue(f"q-{uuid.uuid4().hex[:8]}", Exchange("ex", type="direct"), routing_key="rk")
    q(conn.default_channel).declare()
    return q


def _receive(conn: Connection, queue: Queue) -> Any:
    """The raw message (not decoded: a binary body must not need an accepted serializer)."""
    message = queue(conn.default_channel).get(no_ack=True)
    assert message is not None, "nothing was published to the queue"
    return message


def _received(conn: Connection, body: bytes | str, content_type: str, content_encoding: str,
              headers: dict[str, Any], **props: Any) -> Any:
    """Publish raw bytes and receive them: a real kombu Message as a worker sees it."""
    queue = _queue(conn)
    conn.Producer().publish(body, exchange="ex", routing_key="rk", content_type=content_type,
                            content_encoding=content_encoding, headers=headers, **props)
    return _receive(conn, queue), queue


def test_text_body_round_trip(conn: Connection) -> None:
    body = json.dumps([[1, "ü"], {"k": 2}, {"callbacks": None}])
    headers = {"id": "tid-1", "task": "proj.ingest", "work_key": "wk-1", "retries": 0}
    original, queue = _received(conn, body.encode(), "application/json", "utf-8", headers,
                                correlation_id="tid-1", priority=3)
    stored = messages.from_kombu(original)
    assert json.loads(stored)["body"] == {"text": body}

    messages.publish(conn, stored, {"resilient_republished": 1})
    again = _receive(conn, queue)
    assert again.body == original.body
    assert again.content_type == "application/json"
    assert again.content_encoding == "utf-8"
    assert again.headers == {**headers, "resilient_republished": 1}
    assert again.properties["correlation_id"] == "tid-1"
    assert again.properties["priority"] == 3
    assert again.delivery_info["routing_key"] == "rk"


@pytest.mark.parametrize("body", [bytes(range(256)), b"\x80\x04\x95 pickle-ish \xff"])
def test_binary_body_round_trip(conn: Connection, body: bytes) -> None:
    original, queue = _received(conn, body, "application/x-python-serialize", "binary",
                                {"id": "tid-2"})
    stored = messages.from_kombu(original)
    assert "b64" in json.loads(stored)["body"]
    messages.publish(conn, stored, {})
    again = _receive(conn, queue)
    assert again.body == body
    assert again.content_type == "application/x-python-serialize"
    assert again.headers["id"] == "tid-2"


def test_binary_body_that_happens_to_be_utf8_round_trips(conn: Connection) -> None:
    """A binary-encoded body (msgpack, pickle protocol 0) may be valid UTF-8 by chance."""
    body = b"(lp0\nI1\na."  # pickle protocol 0 of [1]: plain ASCII, yet binary-encoded
    original, queue = _received(conn, body, "application/x-python-serialize", "binary",
                                {"id": "tid-3"})
    messages.publish(conn, messages.from_kombu(original), {})
    again = _receive(conn, queue)
    assert again.body == body
    assert again.content_encoding == "binary"


def test_from_publish_matches_what_a_worker_receives(conn: Connection) -> None:
    body = json.dumps([[5], {}, {}])
    stored = messages.from_publish(body.encode(), "application/json", "utf-8",
                                   {"id": "tid-4", "task": "t"}, {"correlation_id": "tid-4",
                                                                  "delivery_mode": 2},
                                   "ex", "rk")
    assert json.loads(stored)["properties"] == {"correlation_id": "tid-4"}
    queue = _queue(conn)
    messages.publish(conn, stored, {"resilient_republished": 1})
    again = _receive(conn, queue)
    assert again.body.decode() == body
    assert again.headers == {"id": "tid-4", "task": "t", "resilient_republished": 1}


def test_from_publish_binary(conn: Connection) -> None:
    body = b"\xff\x00\xfe"
    stored = messages.from_publish(body, "application/x-msgpack", "binary", {"id": "t5"}, {},
                                   "ex", "rk")
    queue = _queue(conn)
    messages.publish(conn, stored, {})
    assert _receive(conn, queue).body == body


def test_from_kombu_accepts_a_bare_message_object() -> None:
    """Fields the broker did not set (no delivery info, no properties) become defaults."""
    msg = Message(body="{}", content_type="application/json", content_encoding="utf-8",
                  headers=None, properties=None, delivery_info=None)
    stored = json.loads(messages.from_kombu(msg))
    assert stored == {"body": {"text": "{}"}, "content_type": "application/json",
                      "content_encoding": "utf-8", "headers": {}, "properties": {},
                      "exchange": "", "routing_key": ""}
