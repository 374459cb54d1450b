"""The exact broker message of a unit of work, kept in the store so it can be re-sent.

Two forms are stored, both JSON:

* the **delivered message** (``from_kombu``, ``from_publish``): the body is kept as the
  serialized bytes the broker delivered (base64 when not text), so a re-publish is byte for
  byte the original whatever serializer the app uses, and the same task id and headers reach
  the next worker;
* the **call form** (``from_signature``), when no delivered bytes are at hand (a take that
  beat its receipt, a durable submit): task name, arguments and options, re-sent through
  ``apply_async``. Arguments that JSON cannot carry are kept serialized with the task's own
  serializer (pickle, msgpack, YAML...), under ``serialized`` with their content type, and
  re-sent with that serializer; the options stay readable JSON.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Iterable
from typing import Any

from kombu.connection import Connection
from kombu.serialization import prepare_accept_content, registry

from celery_resilient.core import codec
from celery_resilient.errors import SerializationError

log = logging.getLogger(__name__)
#: Header on every copy the library re-publishes (sweep, hand-off, operator re-publish).
REPUBLISHED_HEADER = "resilient_republished"
KEEP_PROPERTIES = ("correlation_id", "reply_to", "priority")
#: The fields of a signature moved into ``serialized`` when JSON cannot carry them: the
#: arguments first; the options too when they hold something JSON cannot (a callback's
#: arguments, a header).
_MOVABLE = (("args", "kwargs"), ("args", "kwargs", "options"))


def from_kombu(message: Any) -> str:
    """Encode a received ``kombu.Message`` for the store."""
    info = message.delivery_info or {}
    props = message.properties or {}
    return _encode(message.body, message.content_type, message.content_encoding,
                   dict(message.headers or {}), props, info.get("exchange") or "",
                   info.get("routing_key") or "")


def from_publish(body: bytes | str, content_type: str, content_encoding: str,
                 headers: dict[str, Any], properties: dict[str, Any], exchange: str,
                 routing_key: str) -> str:
    """Encode a message about to be published (durable submit)."""
    return _encode(body, content_type, content_encoding, headers, properties, exchange,
                   routing_key)


def _encode(body: bytes | str, content_type: str | None, content_encoding: str | None,
            headers: dict[str, Any], properties: dict[str, Any], exchange: str,
            routing_key: str) -> str:
    return json.dumps({
        "body": _body_field(body, content_encoding),
        "content_type": content_type,
        "content_encoding": content_encoding,
        "headers": headers,
        "properties": {k: properties[k] for k in KEEP_PROPERTIES if properties.get(k) is not None},
        "exchange": exchange or "",
        "routing_key": routing_key or "",
    }, default=str)


def _body_field(body: bytes | str, content_encoding: str | None) -> dict[str, str]:
    # Text only when the message itself says its body is UTF-8 text; anything else (pickle,
    # msgpack, "binary") is kept as exact bytes, even when those bytes happen to be ASCII.
    raw = body.encode(content_encoding or "utf-8") if isinstance(body, str) else bytes(body)
    if (content_encoding or "").lower().replace("-", "") == "utf8":
        try:
            return {"text": raw.decode("utf-8")}
        except UnicodeDecodeError:
            pass
    return {"b64": base64.b64encode(raw).decode("ascii")}


def _body_bytes(field: dict[str, Any], content_encoding: str | None) -> bytes:
    """The exact bytes a body field keeps (never re-encoded)."""
    if "b64" in field:
        return base64.b64decode(field["b64"])
    text: str = field["text"]
    return text.encode(content_encoding or "utf-8")


# -- the call form ------------------------------------------------------------------------------

def from_signature(signature: Any, serializer: str | None = None) -> str | None:
    """The call form of a message (task, args, kwargs, options incl. task id), when the
    delivered bytes are not at hand.

    Plain JSON when the message's serializer is JSON. Otherwise the arguments are kept
    serialized with that serializer: ``serializer`` when given, else the one named in the
    signature's options, else its task's (``task_serializer``); then any other serializer
    the app accepts. None when none of them can serialize the arguments: the work then has
    no re-publishable message. Never raises (a take calls it inside its transaction).
    """
    try:
        fields = dict(signature)
        names = _serializers(signature, fields, serializer)
    except Exception as exc:
        log.warning("no call form for %r: %s", signature, exc)
        return None
    for name in names:
        try:
            kept = _call_form(fields, name)
        except Exception as exc:  # a serializer is third-party code: anything may escape it
            log.debug("call form of %s not kept with %s: %s", fields.get("task"), name, exc)
            continue
        if kept is not None:
            return kept
    return None


def _serializers(signature: Any, fields: dict[str, Any], serializer: str | None) -> list[str]:
    """Serializer names to try, the message's own first; only those kombu has installed."""
    options = fields.get("options") or {}
    app = getattr(signature, "app", None)
    conf = getattr(app, "conf", None)
    task = getattr(signature, "_type", None)  # never looks the task up (that finalizes apps)
    names: list[Any] = [serializer, options.get("serializer"), getattr(task, "serializer", None)]
    if conf is not None:
        names.append(conf.task_serializer)
        names.extend(registry.type_to_name.get(c, c) for c in (conf.accept_content or ()))
    names.append("json")
    known = set(registry.name_to_type)
    return [n for n in dict.fromkeys(names) if isinstance(n, str) and n in known]


def _call_form(fields: dict[str, Any], name: str) -> str | None:
    if name == "json":
        try:
            return json.dumps({"signature": json.loads(codec.encode(fields, "signature"))})
        except SerializationError:
            return None
    for moved in _MOVABLE:
        try:
            kept = json.loads(codec.encode({k: v for k, v in fields.items() if k not in moved},
                                           "signature"))
        except SerializationError:
            continue  # something else JSON cannot carry: move the options as well
        content_type, content_encoding, data = registry.dumps(  # type: ignore[no-untyped-call]
            {k: fields[k] for k in moved if k in fields}, serializer=name)
        return json.dumps({"signature": kept, "serialized": {
            "content_type": content_type, "content_encoding": content_encoding,
            **_body_field(data, content_encoding)}})
    return None


def _signature_fields(m: dict[str, Any], accept: Iterable[str] | None) -> tuple[dict[str, Any],
                                                                              str | None]:
    """The signature a call form keeps, and the serializer its arguments were kept with."""
    fields = codec.decode(json.dumps(m["signature"]), "stored call form")
    if not isinstance(fields, dict):
        raise SerializationError("the stored call form is corrupted: its signature is not an "
                                 "object; repair or delete the row")
    packed = m.get("serialized")
    if packed is None:
        return fields, None
    content_type = packed.get("content_type")
    name = registry.type_to_name.get(content_type)
    if name is None:
        raise SerializationError(
            f"the stored arguments are {content_type!r}, which no serializer installed here "
            "decodes; install it (e.g. msgpack) in the worker, or cancel the work")
    encoding = packed.get("content_encoding")
    accepted = None if accept is None else prepare_accept_content(accept)  # type: ignore[no-untyped-call]
    try:
        moved = registry.loads(  # type: ignore[no-untyped-call]
            _body_bytes(packed, encoding), content_type, encoding, accept=accepted)
    except Exception as exc:
        raise SerializationError(
            f"the stored arguments ({content_type}) cannot be decoded here: "
            f"{type(exc).__name__}: {exc}; add {name!r} to accept_content if the app should "
            "accept it, or cancel the work") from None
    if not isinstance(moved, dict):
        raise SerializationError(f"the stored arguments ({content_type}) are corrupted: not a "
                                 "mapping; repair or delete the row")
    return {**fields, **moved}, name


def unpublishable(message_json: str | None, app: Any = None) -> str | None:
    """Why ``publish`` cannot send this stored message, or None when it can."""
    if message_json is None:
        return ("no message is stored: its delivery was never recorded and its arguments "
                "could not be kept by any serializer the app accepts")
    try:
        m = json.loads(message_json)
        if "signature" in m:
            if app is None:
                return "a call-form message needs the Celery app to be re-sent"
            _signature_fields(m, app.conf.accept_content)
        elif not isinstance(m.get("body"), dict):
            return "the stored message has no body"
    except SerializationError as exc:
        return str(exc)
    except (ValueError, TypeError, KeyError) as exc:
        return f"the stored message is corrupted ({type(exc).__name__}: {exc})"
    return None


def publish(connection: Connection, message_json: str, extra_headers: dict[str, Any],
            app: Any = None, retries: int | None = None, started: bool = False) -> None:
    """Send a stored message again, unchanged but for ``extra_headers`` and, when given,
    Celery's ``retries`` (the try the copy is sent as).

    ``started``: the copy continues work whose body already ran (a warm shutdown's
    hand-off), so it is sent without Celery's ``expires``. That option says when work may
    no longer *start*; kept, it made the receiving worker discard a continuation as expired
    once the time passed, leaving the work half done where plain Celery would have finished
    it in its drain.

    A call form is sent through ``apply_async`` with the serializer its arguments were kept
    with; :class:`SerializationError` when they cannot be decoded here (a content type the
    app does not accept).
    """
    m = json.loads(message_json)
    if "signature" in m:
        if app is None:
            raise ValueError("a call-form message needs the Celery app to be re-sent")
        fields, serializer = _signature_fields(m, app.conf.accept_content)
        sig = app.signature(fields)
        options = sig.options
        options["headers"] = {**(options.get("headers") or {}), **extra_headers}
        if retries is not None:
            options["retries"] = retries
        if started:
            options.pop("expires", None)
        if serializer is not None:
            options["serializer"] = serializer
        sig.apply_async(producer=connection.Producer(), **{})  # type: ignore[no-untyped-call]
        return
    encoding = m.get("content_encoding") or "utf-8"
    body = _body_bytes(m["body"], encoding)  # always bytes: never re-encoded
    headers = {**m.get("headers", {}), **extra_headers}
    if retries is not None and "task" in headers:  # protocol 2 keeps retries in the headers
        headers["retries"] = max(retries, int(headers.get("retries") or 0))
    if started and "task" in headers:  # protocol 2 (protocol 1 messages keep theirs)
        headers["expires"] = None
    producer: Any = connection.Producer()  # type: ignore[no-untyped-call]
    producer.publish(
        body,
        exchange=m.get("exchange", ""),
        routing_key=m.get("routing_key", ""),
        headers=headers,
        content_type=m.get("content_type"),
        content_encoding=m.get("content_encoding"),
        retry=True,
        retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
        **m.get("properties", {}),
    )
