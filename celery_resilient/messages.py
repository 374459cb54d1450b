"""The exact broker message of a unit of work, kept in the store so it can be re-sent.

The body is kept as the serialized bytes the broker delivered (base64 when not text), so a
re-publish is byte-for-byte the original whatever serializer the app uses, and the same task
id and headers reach the next worker.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from kombu.connection import Connection

KEEP_PROPERTIES = ("correlation_id", "reply_to", "priority")


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
    # Text only when the message itself says its body is UTF-8 text; anything else (pickle,
    # msgpack, "binary") is kept as exact bytes, even when those bytes happen to be ASCII.
    raw = body.encode(content_encoding or "utf-8") if isinstance(body, str) else bytes(body)
    body_field: dict[str, str]
    if (content_encoding or "").lower().replace("-", "") == "utf8":
        try:
            body_field = {"text": raw.decode("utf-8")}
        except UnicodeDecodeError:
            body_field = {"b64": base64.b64encode(raw).decode("ascii")}
    else:
        body_field = {"b64": base64.b64encode(raw).decode("ascii")}
    return json.dumps({
        "body": body_field,
        "content_type": content_type,
        "content_encoding": content_encoding,
        "headers": headers,
        "properties": {k: properties[k] for k in KEEP_PROPERTIES if properties.get(k) is not None},
        "exchange": exchange or "",
        "routing_key": routing_key or "",
    }, default=str)


def from_signature(signature: Any) -> str | None:
    """The call form of a message (task, args, kwargs, options incl. task id), when the
    delivered bytes are not at hand; None when the arguments are not JSON."""
    from .codec import encode
    from .errors import SerializationError

    try:
        return json.dumps({"signature": json.loads(encode(dict(signature), "signature"))})
    except SerializationError:
        return None


def publish(connection: Connection, message_json: str, extra_headers: dict[str, Any],
            app: Any = None, retries: int | None = None) -> None:
    """Send a stored message again, unchanged but for ``extra_headers`` and, when given,
    Celery's ``retries`` (the try the copy is sent as)."""
    m = json.loads(message_json)
    if "signature" in m:
        if app is None:
            raise ValueError("a call-form message needs the Celery app to be re-sent")
        from .codec import decode

        sig = app.signature(decode(json.dumps(m["signature"])))
        options = sig.options
        options["headers"] = {**(options.get("headers") or {}), **extra_headers}
        if retries is not None:
            options["retries"] = retries
        sig.apply_async(producer=connection.Producer(), **{})  # type: ignore[no-untyped-call]
        return
    body_field = m["body"]
    encoding = m.get("content_encoding") or "utf-8"
    body = (base64.b64decode(body_field["b64"]) if "b64" in body_field
            else body_field["text"].encode(encoding))  # always bytes: never re-encoded
    headers = {**m.get("headers", {}), **extra_headers}
    if retries is not None and "task" in headers:  # protocol 2 keeps retries in the headers
        headers["retries"] = max(retries, int(headers.get("retries") or 0))
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
