"""Work keys: the stable identity of a unit of work, whatever message carries it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_resilient.errors import ResilientError

HEADER = "work_key"
MAX_LENGTH = 255


def validate(key: object, source: str) -> str:
    if not isinstance(key, str) or not key:
        raise ResilientError(f"{source} must return a non-empty string, got {key!r}")
    if len(key) > MAX_LENGTH:
        raise ResilientError(f"{source} returned a key of {len(key)} chars; max is {MAX_LENGTH}")
    return key


def derive(
    task: Any, task_id: str, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
    headers: Mapping[str, Any] | None,
) -> str:
    """Header first (the sender's explicit choice), then the task's hook, then the task id.

    The task's name and id are stored beside the key, in columns of the same width: either
    longer is refused here, by name, rather than by the database mid-take."""
    for what, value in (("task name", getattr(task, "name", None)), ("task id", task_id)):
        if isinstance(value, str) and len(value) > MAX_LENGTH:
            raise ResilientError(f"the {what} {value[:40]!r}... is {len(value)} chars; the "
                                 f"store keeps at most {MAX_LENGTH}")
    if headers and headers.get(HEADER) is not None:  # an empty header is an error, not ignored
        return validate(headers[HEADER], f"the {HEADER!r} header")
    hook = getattr(task, "derive_work_key", None)
    if callable(hook):
        key = hook(tuple(args or ()), dict(kwargs or {}))
        if key is not None:
            return validate(key, f"{type(task).__name__}.derive_work_key()")
    return validate(task_id, "the task id")
