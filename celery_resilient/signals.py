"""Celery-style signals for every recovery action, sent where the action is logged.

Connect as to any Celery signal::

    from celery_resilient import signals

    @signals.work_recovered.connect
    def on_recovered(sender, work_key, task_id, **kwargs):
        ...

Every signal is sent with ``app`` (the Celery app) and the keyword arguments listed below;
receivers must accept ``**kwargs`` (more may be added). ``sender`` is the task name (the
entry name for ``slot_caught_up``), so ``connect(sender="proj.ingest")`` filters by task. A
receiver that raises is logged by Celery and never disturbs the library. Signals are sent in
the process where the action happens: ``work_recovered`` in the worker's main process (or the
``celery resilient recover`` command), ``duplicate_skipped``, ``work_fenced``,
``work_dead`` and ``work_handed_off`` in the pool process that received the delivery,
``slot_caught_up`` in beat, ``rows_pruned`` in the worker's main process (its maintainer
thread).

With ``resilient_metrics = True`` the Prometheus counters of :mod:`celery_resilient.runtime.metrics`
are connected to these signals in each process when the app's settings are first read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.utils.dispatch import Signal

if TYPE_CHECKING:
    from celery import Celery

#: Orphaned work was re-published with its task id. Sender: the task name.
#: kwargs: ``work_key``, ``task_id``, ``previous_state`` (``reserved``/``running``/``requeued``),
#: ``previous_owner`` (node name or None).
work_recovered = Signal(name="work_recovered", providing_args={
    "app", "work_key", "task_id", "previous_state", "previous_owner"})

#: A delivery ran nothing: the work is done (its stored result is returned), held by a live
#: execution, or this very message already failed. Sender: the task name.
#: kwargs: ``work_key``, ``task_id``, ``task`` (the name), ``reason``.
duplicate_skipped = Signal(name="duplicate_skipped", providing_args={
    "app", "work_key", "task_id", "task", "reason"})

#: A superseded execution's write was refused (``StaleClaimError``): a newer execution owns
#: the work. Sender: the task name. kwargs: ``work_key``, ``task_id``, ``task``, ``epoch`` (the
#: refused execution's fencing token), ``error`` (the message).
work_fenced = Signal(name="work_fenced", providing_args={
    "app", "work_key", "task_id", "task", "epoch", "error"})

#: A delivery found the work ``dead`` (it died ``resilient_max_attempts`` times): sent by the
#: take that parks it and by every later delivery. Sender: the task name.
#: kwargs: ``work_key``, ``task_id``, ``task``, ``reason``.
work_dead = Signal(name="work_dead", providing_args={
    "app", "work_key", "task_id", "task", "reason"})

#: Beat sent a slot that was missed (late beyond the grace, or before this beat started).
#: Sender: the entry name. kwargs: ``entry``, ``slot`` (ISO 8601 in the schedule's timezone),
#: ``task_id``, ``late_seconds``.
slot_caught_up = Signal(name="slot_caught_up", providing_args={
    "app", "entry", "slot", "task_id", "late_seconds"})

#: A running execution handed its work back at a warm shutdown (``resilient_shutdown =
#: "hand_off"``), after its checkpoint committed. Sender: the task name. kwargs:
#: ``work_key``, ``task_id``, ``task``, ``epoch`` (the execution's fencing token),
#: ``republished`` (False: the message could not be sent now; the sweeper sends it later).
work_handed_off = Signal(name="work_handed_off", providing_args={
    "app", "work_key", "task_id", "task", "epoch", "republished"})

#: Automatic retention deleted rows of one table (one batch, one transaction; see
#: ``docs/operations.md``). Sender: the table's name without its prefix (``work``,
#: ``steps``, ``ledger``, ``revocations``, ``workers``, ``schedule_runs``,
#: ``contexts``). kwargs: ``table`` (the same name), ``rows`` (how many were deleted).
rows_pruned = Signal(name="rows_pruned", providing_args={"app", "table", "rows"})

ALL = (work_recovered, duplicate_skipped, work_fenced, work_dead, slot_caught_up,
       work_handed_off, rows_pruned)


def send(signal: Signal, app: Celery, sender: str, **kwargs: Any) -> None:
    """Send ``signal`` for ``app`` (the receivers get ``app`` as a keyword argument)."""
    signal.send(sender=sender, app=app, **kwargs)


__all__ = ["ALL", "duplicate_skipped", "rows_pruned", "send", "slot_caught_up", "work_dead",
           "work_fenced", "work_handed_off", "work_recovered"]
