"""Durable submit (opt-in ``resilient_durable_submit``): the work and a re-publishable message
go into the store before the broker sees the message, which survives a broker that loses its
data.

Celery sends every task message through ``app.send_task``: ``apply_async`` and ``delay``,
``send_task`` by name, canvas parts, a chord's body, beat's slots. :func:`covering` wraps it
on the app ``Resilient(app)`` was applied to, so all of them are covered alike. What is not
recorded: a task's re-send of itself (a retry or a store-outage re-send: its claim is handed
back with the stored message), the store's own re-publishes, eager calls, plain tasks, and a
task this app does not know by name (its work key cannot be derived here; warned once).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.utils import uuid

from celery_resilient.core import codec, messages, workkey
from celery_resilient.errors import SerializationError
from celery_resilient.runtime.runtime import Runtime

log = logging.getLogger(__name__)

# Options of send_task that are live objects, not part of the message.
_LOCAL_OPTIONS = ("producer", "connection", "router", "publisher", "add_to_parent",
                  "result_cls", "task_type")


def covering(rt: Runtime, send_task: Callable[..., Any],
             is_resumable: Callable[[Any], bool]) -> Callable[..., Any]:
    """``app.send_task`` (the bound method ``send_task``) with durable submit in front."""
    unknown: set[str] = set()

    @functools.wraps(send_task)
    def send(name: str, args: Any = None, kwargs: Any = None, countdown: float | None = None,
             eta: Any = None, task_id: str | None = None, **options: Any) -> Any:
        recorded: str | None = None
        if rt.config.durable_submit and not rt.app.conf.task_always_eager:
            task = options.get("task_type") or rt.app.tasks.get(name)
            if task is None:
                if name not in unknown:
                    unknown.add(name)
                    log.warning("durable submit does not cover send_task(%r): this app does "
                                "not know the task (import its module where you send it)",
                                name, extra={"action": "submit_unrecorded", "task": name})
            elif is_resumable(task) and _recorded_here(task, task_id, options):
                task_id = task_id or uuid()
                when = _eta(countdown, eta)
                recorded = record_submission(
                    rt, task, args or (), kwargs or {}, task_id,
                    {**options, **({"eta": when.isoformat()} if when else {})},
                    delay=_delay(when))
        try:
            return send_task(name, args, kwargs, countdown=countdown, eta=eta,
                             task_id=task_id, **options)
        except Exception:
            if recorded is not None and task_id is not None:
                _withdraw(rt, recorded, task_id)
            raise

    return send


def _withdraw(rt: Runtime, work_key: str, task_id: str) -> None:
    """The publish failed and the caller hears it: nothing is left to run behind its back."""
    try:
        rt.store.withdraw_submission(work_key, task_id)
    except Exception as exc:  # the store went too: its hold re-publishes it later
        log.warning("durable submit of %s: the publish failed and its record could not be "
                    "withdrawn (%s); the store sends it after resilient_submit_timeout",
                    task_id, exc, extra={"action": "submit_withdraw_failed",
                                         "task_id": task_id})


def _recorded_here(task: Any, task_id: str | None, options: dict[str, Any]) -> bool:
    """Not a re-send of the running request (same task, same id) or a store re-publish."""
    headers = options.get("headers") or {}
    if headers.get(messages.REPUBLISHED_HEADER):
        return False
    return task_id is None or task_id != getattr(task.request, "id", None)


def _eta(countdown: float | None, eta: Any) -> datetime | None:
    """An absolute time (a countdown stored as such would restart at each re-publish)."""
    if eta is not None:
        return eta if isinstance(eta, datetime) else datetime.fromisoformat(str(eta))
    if countdown:
        return datetime.now(timezone.utc) + timedelta(seconds=countdown)
    return None


def _delay(when: datetime | None) -> float:
    if when is None:
        return 0.0
    aware = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    return max(0.0, (aware - datetime.now(timezone.utc)).total_seconds())


def record_submission(rt: Runtime, task: Any, args: Any, kwargs: Any, task_id: str,
                      options: dict[str, Any], delay: float = 0.0) -> str:
    """Durable submit: the work is in the store before the broker sees its message.

    Raises :class:`StoreUnavailable` to the caller when the store is down, before anything
    is published, so a submission is never silently without its record. The message is kept
    in the call form: JSON, or arguments JSON cannot carry serialized with the message's own
    serializer (``serializer=`` of the call, else the task's), so pickle, msgpack and YAML
    tasks are submitted durably like JSON ones. A message due later (``delay`` seconds: an
    ETA or countdown) is held that much longer before the store re-publishes it. Returns
    the work key.
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
                               delay + rt.config.submit_timeout)
    return key
