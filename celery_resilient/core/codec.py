"""JSON in and out of the store: the same encoding Celery's ``json`` serializer uses.

kombu's JSON keeps datetimes, dates, UUIDs and Decimals round-trippable; anything else is a
:class:`SerializationError` naming what could not be stored. Nothing is ever pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads as _kombu_loads

from celery_resilient.errors import ResilientError, SerializationError

_dumps: Callable[[Any], str] = _kombu_dumps
_loads: Callable[[str], Any] = _kombu_loads


def encode(value: Any, what: str = "value") -> str:
    try:
        text: str = _dumps(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise SerializationError(
            f"{what} is not JSON-serialisable ({exc}); store plain dicts, lists, strings, "
            "numbers, booleans, None, datetimes, UUIDs or Decimals"
        ) from None
    return text


def decode(text: str | None, what: str = "stored value") -> Any:
    """The value stored as ``text``; a corrupted row is a :class:`SerializationError`."""
    if text is None:
        return None
    try:
        return _loads(text)
    except ValueError as exc:  # json.JSONDecodeError, or a bad kombu type marker
        raise SerializationError(
            f"{what} is corrupted: not valid JSON ({exc}); it was changed outside "
            "celery-resilient. Repair or delete the row; nothing was overwritten"
        ) from None


def digest(value: Any) -> str:
    """A stable fingerprint of JSON-able arguments (canonical key order)."""
    canonical = json.dumps(_loads(encode(value, "task arguments")), sort_keys=True,
                           separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def args_digest(args: Any, kwargs: Any) -> str | None:
    """The fingerprint of a call's arguments, or None when JSON cannot carry them (then a
    replay with other arguments cannot be told apart, and is not refused)."""
    try:
        return digest([list(args or ()), dict(kwargs or {})])
    except ResilientError:
        return None


def failure_json(exc: BaseException) -> str | None:
    """``exc`` in the form Celery's JSON result backends store an exception in."""
    try:
        return encode({"exc_type": type(exc).__name__, "exc_message": list(exc.args),
                       "exc_module": type(exc).__module__}, "a task's failure")
    except Exception:  # arguments that are not JSON: keep the type and the text
        try:
            return encode({"exc_type": type(exc).__name__, "exc_message": [str(exc)],
                           "exc_module": type(exc).__module__}, "a task's failure")
        except Exception:
            return None
