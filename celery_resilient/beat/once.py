"""One start per beat slot for plain tasks, however many copies of the slot's message exist.

``ResilientScheduler`` claims a slot, publishes it, then records it sent. A beat killed between
the publish and the record (or a store error at the record) leaves the slot ``claimed``, and
the next beat sends it again: two messages for one slot, with the same task id, work key and
headers. A :class:`~celery_resilient.ResumableTask` runs that work key once (its claim). A
plain task has no claim, so the worker checks the slot itself, just before the body:

- The check runs in the pool process, in the task's ``before_start`` (Celery calls it inside
  the trace, right before the body; an ``Ignore`` raised there skips the body and acks the
  message). :class:`SlotOnceStep`, added by ``Resilient(app)``, gives every non-resumable task
  of the app that ``before_start`` (wrapping any the task defines) before the worker builds
  its tracers.
- Only messages carrying the scheduler's slot headers (:data:`SCHEDULED_FOR_HEADER` and
  :data:`ENTRY_HEADER`) pay the store round trip; any other message pays one header lookup.
- The store moves the slot's row to ``started`` with this process as owner
  (:meth:`ScheduleStore.start`, one compare-and-set). A copy that finds it ``started`` runs
  nothing: it is acknowledged, logged (``action=duplicate_skipped``) and announced with
  :data:`celery_resilient.signals.duplicate_skipped` (``reason="slot_started"``).

A start is final, as Celery's own acknowledgement is: with the default early ack a plain task
runs at most once once it started, and a worker killed mid-body loses that run, with or without
this check. An ``acks_late`` task keeps Celery's at-least-once: a copy redelivered by the broker
(its starter never acked) or one arriving after the starter provably died (same host) takes
the start over and runs. Retries (``retries > 0``) are the same run continuing and are not
checked. When the store is down the message is sent again later (same task id) rather than run
unchecked or lost.
"""

from __future__ import annotations

import logging
import weakref
from datetime import datetime
from typing import Any, NoReturn

from celery import Celery, bootsteps
from celery.app.trace import task_has_custom
from celery.exceptions import Ignore, Reject, Retry

from celery_resilient import signals
from celery_resilient.beat.windows import to_seconds, to_us
from celery_resilient.core import liveness, workkey
from celery_resilient.errors import StoreUnavailable
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.schedule import Run, Start
from celery_resilient.tasks.task import SCHEDULED_FOR_HEADER, ResumableTask

log = logging.getLogger(__name__)

#: Header naming the slot's entry (RedBeat key), set by the scheduler on every slot message.
ENTRY_HEADER = "resilient_beat_entry"
#: Header of a copy re-sent because the store was down at the check: who tried to start it.
STARTER_HEADER = "resilient_slot_starter"
STORE_RETRIES_HEADER = "resilient_store_retries"
_STARTED = "resilient_slot_started"  # request attribute: this delivery holds the slot's start
_guarded: weakref.WeakSet[type] = weakref.WeakSet()


class SlotOnceStep(bootsteps.Step):  # type: ignore[misc]
    """Worker bootstep: guard the app's plain tasks before the worker builds their tracers."""

    name = "celery_resilient.slot_once"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        guard_tasks(parent.app)


def guard_tasks(app: Celery) -> int:
    """Give every non-resumable task of ``app`` the slot check; return how many were guarded.

    Idempotent. Must run before the worker builds its tracers (Celery reads ``before_start``
    once per task, when it builds the task's tracer).
    """
    n = 0
    for task in app.tasks.values():
        cls = type(task)
        if isinstance(task, ResumableTask) or cls in _guarded:
            continue
        original = cls.before_start if task_has_custom(task, "before_start") else None

        def before_start(self: Any, task_id: str, args: Any, kwargs: Any,
                         _original: Any = original) -> None:
            check_slot(self)
            if _original is not None:
                _original(self, task_id, args, kwargs)

        cls.before_start = before_start
        _guarded.add(cls)
        n += 1
    return n


def check_slot(task: Any) -> None:
    """Run nothing (raise ``Ignore``) if this slot's task already started elsewhere."""
    req = task.request
    scheduled_for = _header(req, SCHEDULED_FOR_HEADER)
    if scheduled_for is None:
        return  # not a beat slot: the hot path pays this lookup only
    entry = _header(req, ENTRY_HEADER)
    if (not isinstance(entry, str) or not isinstance(scheduled_for, str) or req.is_eager
            or req.called_directly or int(req.retries or 0) > 0 or getattr(req, _STARTED, False)):
        return
    rt = Runtime.enabled_on(task.app)
    if rt is None:
        return
    slot = to_seconds(to_us(datetime.fromisoformat(scheduled_for)))
    me = liveness.current()
    tried = _header(req, STARTER_HEADER)
    redelivered = bool((req.delivery_info or {}).get("redelivered"))
    acks_late = bool(task.acks_late)

    def may_take_over(row: Run) -> bool:
        if tried is not None and row.owner == tried:
            return True  # our own start whose commit outcome was unknown
        return acks_late and (redelivered or liveness.is_dead(row.owner))

    try:
        outcome = rt.store.schedule.start(entry, slot, req.id, me,
                                                take_over=may_take_over)
    except StoreUnavailable as exc:
        _send_later(task, rt, exc, me)
    ctx = {"task_id": req.id, "task": task.name, "entry": entry, "slot": scheduled_for}
    if outcome.started:
        setattr(req, _STARTED, True)
        if outcome.taken_over:
            assert outcome.previous is not None
            log.warning("%s slot %s: start by %s taken over (%s)", entry, scheduled_for,
                        outcome.previous.owner,
                        "redelivered" if redelivered else "its starter is gone",
                        extra={"action": "slot_start_taken_over", **ctx})
        return
    reason = "slot_skipped" if _state(outcome) == "skipped" else "slot_started"
    log.info("%s slot %s already %s by %s; %s[%s] not run", entry, scheduled_for,
             _state(outcome), outcome.previous.owner if outcome.previous else None,
             task.name, req.id, extra={"action": "duplicate_skipped", "reason": reason, **ctx})
    signals.send(signals.duplicate_skipped, task.app, task.name, reason=reason,
                 work_key=_header(req, workkey.HEADER), task_id=req.id, task=task.name)
    raise Ignore()


def _send_later(task: Any, rt: Runtime, exc: StoreUnavailable, me: str) -> NoReturn:
    """The store is down: send this message again later (same id, same headers)."""
    req = task.request
    n = int(_header(req, STORE_RETRIES_HEADER) or 0)
    countdown = min(rt.config.store_retry_base * (2 ** n), rt.config.store_retry_max)
    headers = {name: value for name in (SCHEDULED_FOR_HEADER, ENTRY_HEADER, workkey.HEADER,
                                        "celery_beat_task")
               if (value := _header(req, name)) is not None}
    headers.update({STORE_RETRIES_HEADER: n + 1, STARTER_HEADER: me})
    log.warning("store unavailable (%s); slot task %s re-sent in %.1fs", exc, req.id, countdown,
                extra={"action": "store_retry", "task_id": req.id})
    sig = task.signature_from_request(req, countdown=countdown, headers=headers)
    try:
        sig.apply_async()
    except Exception as publish_error:  # broker down too: let the broker keep it (acks_late)
        raise Reject(str(publish_error), requeue=True) from exc
    raise Retry(exc=exc, when=countdown, sig=sig)


def _state(outcome: Start) -> str:
    return outcome.previous.state if outcome.previous is not None else "gone"


def _header(req: Any, name: str) -> Any:
    """A custom header: a request attribute (protocol 2) or in ``request.headers``."""
    value = getattr(req, name, None)
    if value is None:
        headers = getattr(req, "headers", None)
        if isinstance(headers, dict):
            value = headers.get(name)
    return value


__all__ = ["ENTRY_HEADER", "SlotOnceStep", "check_slot", "guard_tasks"]
