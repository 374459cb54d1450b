"""Durable submit (opt-in ``resilient_durable_submit``): ``ResumableTask.apply_async`` puts
the work and a re-publishable message into the store before the broker sees it, which
survives a broker that loses its data."""

from __future__ import annotations

from typing import Any

from celery_resilient.core import codec, messages, workkey
from celery_resilient.errors import SerializationError
from celery_resilient.runtime.runtime import Runtime

# Options of apply_async that are live objects, not part of the message.
_LOCAL_OPTIONS = ("producer", "connection", "router", "publisher", "add_to_parent")


def record_submission(rt: Runtime, task: Any, args: Any, kwargs: Any, task_id: str,
                      options: dict[str, Any]) -> None:
    """Durable submit: the work is in the store before the broker sees its message.

    Raises :class:`StoreUnavailable` to the caller of ``apply_async`` when the store is down,
    before anything is published, so a submission is never silently without its record.
    The message is kept in the call form: JSON, or arguments JSON cannot carry serialized
    with the message's own serializer (``serializer=`` of the call, else the task's), so
    pickle, msgpack and YAML tasks are submitted durably like JSON ones.
    """
    kept = {k: v for k, v in options.items() if k not in _LOCAL_OPTIONS}
    signature = task.signature(args, kwargs, {**kept, "task_id": task_id})
    message = messages.from_signature(signature)
    if message is None:
        serializer = kept.get("serializer") or task.serializer
        raise SerializationError(
            f"durable submit of {task.name}: its arguments and options cannot be kept in the "
            f"store: neither its serializer ({serializer!r}) nor any other the app accepts "
            "can serialize them; send arguments that serializer can carry, or disable "
            "resilient_durable_submit"
        )
    headers = options.get("headers") or {}
    key = workkey.derive(task, task_id, args, kwargs, headers)
    rt.store.record_submission(key, task.name, task_id, codec.args_digest(args, kwargs), message,
                               rt.config.submit_timeout)
