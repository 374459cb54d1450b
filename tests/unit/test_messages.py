"""messages: a stored broker message re-publishes byte for byte (kombu's in-memory transport)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.message import Message
from kombu.serialization import registry

from celery_resilient.core import messages
from celery_resilient.errors import SerializationError


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


# -- the call form: any serializer the app accepts ------------------------------------------

SINCE = datetime(2024, 2, 29, 12, 30, tzinfo=timezone.utc)


class Point:
    """A class instance: pickle carries it, JSON and YAML (safe) do not."""

    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x

    def __hash__(self) -> int:
        return self.x


#: serializer -> (args, kwargs) JSON cannot carry as they are, but that serializer can.
NOT_JSON: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "pickle": (({1, 2}, SINCE, Point(3), (4, "four")), {"raw": b"\x00\xff", "at": Decimal("1.5")}),
    "yaml": (({1, 2}, SINCE, b"\x00\xff"), {"when": SINCE.date(), "tags": {"a"}}),
}


def _app(serializer: str, accept: tuple[str, ...] | None = None) -> Celery:
    app = Celery(f"call-form-{serializer}", set_as_current=False)
    app.conf.update(task_serializer=serializer, accept_content=list(accept or (serializer,)),
                    task_default_queue=f"q-{uuid.uuid4().hex[:8]}")
    return app


def _task(app: Celery) -> Any:
    @app.task(bind=True, shared=False, name="proj.job")
    def job(self: Any, *args: Any, **kwargs: Any) -> None:
        """Never run here: only its signatures are built."""

    return job


def _published(conn: Connection, app: Celery, stored: str) -> tuple[Any, Any]:
    """Publish ``stored`` through ``app``; the raw message and its decoded (args, kwargs)."""
    queue = Queue(app.conf.task_default_queue, Exchange(app.conf.task_default_queue),
                  routing_key=app.conf.task_default_queue)
    queue(conn.default_channel).declare()
    messages.publish(conn, stored, {"resilient_republished": 1}, app, retries=2)
    raw = _receive(conn, queue)
    args, kwargs, _embed = registry.loads(raw.body, raw.content_type, raw.content_encoding,
                                          accept={raw.content_type})
    return raw, (args, kwargs)


@pytest.mark.parametrize("serializer", sorted(NOT_JSON))
def test_call_form_keeps_arguments_with_the_tasks_serializer(conn: Connection,
                                                             serializer: str) -> None:
    app = _app(serializer)
    args, kwargs = NOT_JSON[serializer]
    sig = _task(app).signature(args, kwargs, task_id="tid-cf", headers={"work_key": "wk"},
                               expires=SINCE)
    stored = messages.from_signature(sig)
    assert stored is not None, "the take would keep no re-publishable message"
    form = json.loads(stored)
    assert form["serialized"]["content_type"] == registry.name_to_type[serializer]
    # Only the arguments are serialized: the options stay JSON an operator can read and edit.
    assert "args" not in form["signature"] and "kwargs" not in form["signature"]
    assert form["signature"]["options"]["task_id"] == "tid-cf"
    assert messages.unpublishable(stored, app) is None

    raw, (sent_args, sent_kwargs) = _published(conn, app, stored)
    assert raw.content_type == registry.name_to_type[serializer]  # the same serializer
    assert raw.headers["id"] == "tid-cf" and raw.headers["task"] == "proj.job"
    assert raw.headers["work_key"] == "wk" and raw.headers["resilient_republished"] == 1
    assert raw.headers["retries"] == 2
    if serializer == "pickle":  # exact types, tuples included
        assert sent_args == args and sent_kwargs == kwargs
    else:  # YAML has no tuples: a sequence comes back as a list, as in any YAML message
        assert list(sent_args) == list(args) and sent_kwargs == kwargs
    app.close()


def test_json_call_form_is_plain_json(conn: Connection) -> None:
    """JSON tasks keep the plain call form, readable in the store, as before."""
    app = _app("json")
    stored = messages.from_signature(_task(app).signature((1, SINCE), {"k": "v"},
                                                          task_id="tid-json"))
    assert stored is not None
    form = json.loads(stored)
    assert "serialized" not in form and form["signature"]["args"][0] == 1
    raw, (args, kwargs) = _published(conn, app, stored)
    assert raw.content_type == "application/json"
    assert args == [1, SINCE] and kwargs == {"k": "v"}
    app.close()


def test_options_json_cannot_carry_are_serialized_too(conn: Connection) -> None:
    """A callback with pickle-only arguments lives in the options: they move as well."""
    app = _app("pickle")
    job = _task(app)
    sig = job.signature(({3, 4},), task_id="tid-link", link=job.si({5, 6}))
    stored = messages.from_signature(sig)
    assert stored is not None
    form = json.loads(stored)
    assert "options" not in form["signature"]
    raw, (args, _) = _published(conn, app, stored)
    assert args == ({3, 4},)
    assert raw.headers["id"] == "tid-link"
    _, _, embed = registry.loads(raw.body, raw.content_type, raw.content_encoding,
                                 accept={raw.content_type})
    assert embed["callbacks"][0]["args"] == ({5, 6},)
    app.close()


def test_a_serializer_named_in_the_options_comes_first() -> None:
    """apply_async(serializer=...) in a JSON app that also accepts pickle."""
    app = _app("json", accept=("json", "pickle"))
    sig = _task(app).signature(({1},), task_id="tid-opt", serializer="pickle")
    stored = messages.from_signature(sig)
    assert stored is not None
    assert json.loads(stored)["serialized"]["content_type"] == "application/x-python-serialize"
    app.close()


def test_another_accepted_serializer_is_tried_when_the_tasks_cannot() -> None:
    app = _app("json", accept=("json", "pickle"))
    stored = messages.from_signature(_task(app).signature((Point(1),), task_id="tid-any"))
    assert stored is not None
    assert json.loads(stored)["serialized"]["content_type"] == "application/x-python-serialize"
    app.close()


@pytest.mark.parametrize("serializer,value", [
    ("pickle", threading.Lock()),  # pickle cannot carry it
    ("yaml", Point(1)),            # yaml.safe_dump cannot carry a class instance
    ("json", object()),
])
def test_arguments_no_accepted_serializer_carries_give_no_call_form(serializer: str,
                                                                     value: Any) -> None:
    app = _app(serializer)
    assert messages.from_signature(_task(app).signature((value,), task_id="t")) is None
    app.close()


def test_from_signature_never_raises() -> None:
    """A take calls it inside its transaction: a broken signature is no message, not an
    aborted take."""

    class Broken:
        def keys(self) -> Any:
            raise RuntimeError("broken signature")

    assert messages.from_signature(Broken()) is None


def test_a_call_form_the_app_does_not_accept_is_unpublishable(conn: Connection) -> None:
    stored = messages.from_signature(_task(_app("pickle")).signature(({1},), task_id="t"))
    assert stored is not None
    json_only = _app("json")
    why = messages.unpublishable(stored, json_only)
    assert why is not None and "application/x-python-serialize" in why
    assert "accept_content" in why
    with pytest.raises(SerializationError, match="accept_content"):
        messages.publish(conn, stored, {}, json_only)
    json_only.close()


@pytest.mark.parametrize("stored,reason", [
    (None, "no message is stored"),
    ("not json", "corrupted"),
    (json.dumps({"signature": {"task": "t"}, "serialized": {
        "content_type": "application/x-unknown", "content_encoding": "binary", "b64": ""}}),
     "no serializer installed here"),
])
def test_unpublishable_names_the_problem(stored: str | None, reason: str) -> None:
    app = _app("json")
    why = messages.unpublishable(stored, app)
    assert why is not None and reason in why
    app.close()


def test_without_expiry_edits_a_serialized_call_form() -> None:
    """The options of a pickle call form stay JSON: an operator's retry can drop expires."""
    from celery_resilient.ops.operations import without_expiry

    app = _app("pickle")
    stored = messages.from_signature(_task(app).signature(({1},), task_id="t", expires=30))
    assert stored is not None
    dropped = json.loads(without_expiry(stored))
    assert "expires" not in dropped["signature"]["options"]
    assert dropped["serialized"] == json.loads(stored)["serialized"]
    app.close()


@pytest.mark.parametrize("started", [False, True])
def test_a_started_copy_is_sent_without_its_expires(conn: Connection, started: bool) -> None:
    """A hand-off continues work that already ran: Celery's ``expires`` (no start after it)
    must not make the receiving worker discard it; any other copy keeps it."""
    headers = {"id": "tid-x", "task": "proj.ingest", "retries": 0,
               "expires": "2024-02-29T12:30:00+00:00"}
    original, queue = _received(conn, b"[[], {}, {}]", "application/json", "utf-8", headers)
    messages.publish(conn, messages.from_kombu(original), {"resilient_republished": 1},
                     started=started)
    again = _receive(conn, queue)
    assert again.headers["expires"] == (None if started else headers["expires"])
    assert again.headers["resilient_republished"] == 1 and again.headers["id"] == "tid-x"


@pytest.mark.parametrize("started", [False, True])
def test_a_started_call_form_copy_is_sent_without_its_expires(conn: Connection,
                                                              started: bool) -> None:
    app = _app("json")
    sig = _task(app).signature((1,), {}, task_id="tid-cf", headers={"work_key": "wk"},
                               expires=SINCE)
    stored = messages.from_signature(sig)
    assert stored is not None
    queue = Queue(app.conf.task_default_queue, Exchange(app.conf.task_default_queue),
                  routing_key=app.conf.task_default_queue)
    queue(conn.default_channel).declare()
    messages.publish(conn, stored, {"resilient_republished": 1}, app, started=started)
    raw = _receive(conn, queue)
    assert (raw.headers["expires"] is None) == started, raw.headers["expires"]
