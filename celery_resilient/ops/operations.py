"""Operator actions on stored work, shared by the CLI, the Django admin and scripts.

``republish(rt, work_key)`` sends a dead or stuck unit's stored message again, on purpose,
with the same task id and work key. It refuses, with the reason, whatever it cannot re-send
safely or usefully: work running under a live lease (its worker is alive), work already done
(a copy would only return the stored result), work that ended by its own request (failed,
ignored, revoked, expired, cancelled: a copy with the same task id is stopped; ``retry``
is the action for those), and work without a stored message.

``cancel``, ``retry`` and ``forget`` act on a :class:`Selection` (work keys and/or a filter)
and return an :class:`ActionReport` listing what changed and what was refused, and why; the
SQL is in :mod:`celery_resilient.store.operator_queries`. ``retry`` publishes what it
re-queued.

Rows are changed first, in transactions that re-check their state under a row lock; messages
are published after that commits, exactly as the recovery sweep does. If a publish fails, the
row is left ``requeued`` with a lease of ``resilient_submit_timeout``, so a worker's sweeper
sends it again when that runs out.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from celery_resilient.core import messages
from celery_resilient.core.states import DEAD
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.operator_queries import (
    ActionReport,
    Refusal,
    Republished,
    RepublishRefused,
    Selection,
    SelectionError,
    Target,
)

log = logging.getLogger(__name__)


def republish(rt: Runtime, work_key: str) -> Republished:
    """Re-send dead or stuck work now; :class:`RepublishRefused` says why when it cannot.

    Dead work gets its death count reset, so the copy runs instead of being parked again;
    its attempts keep counting. A running claim whose lease expired counts one more death,
    as the recovery sweep counts it.
    """
    row = rt.store.operator.requeue_for_republish(work_key, rt.config.submit_timeout)
    done = Republished(work_key, row.task_id, row.previous_state, row.owner_node,
                       row.previous_state == DEAD)
    assert row.message_json is not None  # republish_refusal() refuses work without one
    extra = {"action": "operator_republished", "work_key": work_key, "task_id": row.task_id,
             "previous_state": row.previous_state, "previous_owner": row.owner_node}
    try:
        with rt.app.connection_for_write() as broker:
            messages.publish(broker, row.message_json, {messages.REPUBLISHED_HEADER: 1}, rt.app)
    except Exception as exc:
        log.warning("operator re-publish of %s failed: %s; a worker's sweep will send it "
                    "after resilient_submit_timeout", work_key, exc,
                    extra={**extra, "action": "republish_failed"})
        raise
    log.info("operator re-published work %s (was %s on %s)", work_key, row.previous_state,
             row.owner_node, extra=extra)
    return done


# -- cancel, retry, forget ----------------------------------------------------------------------

def cancel(rt: Runtime, selection: Selection, reason: str | None = None,
           dry_run: bool = False) -> ActionReport:
    """Cancel open work: it never runs again under its task id; a running execution stops
    at its next fenced write (``WorkStopped``, reported as REVOKED to its caller)."""
    report = rt.store.operator.cancel(selection, reason, dry_run)
    if not dry_run:
        for t in report.changed:
            log.info("operator cancelled work %s (was %s on %s)", t.work_key, t.previous_state,
                     t.owner_node, extra={"action": "operator_cancelled",
                                          "work_key": t.work_key, "task_id": t.task_id,
                                          "previous_state": t.previous_state})
            _report_cancelled(rt, t.task_id, reason)
    return report


def _report_cancelled(rt: Runtime, task_id: str, reason: str | None) -> None:
    """The caller sees REVOKED now: a cancelled request never writes a result of its own
    (its execution, if any, is refused at its next write), and its owner may be gone."""
    why = f"cancelled by operator: {reason}" if reason else "cancelled by operator"
    try:
        rt.app.backend.mark_as_revoked(task_id, why)
    except Exception as exc:  # no result backend, or it is down: the store has the state
        log.info("result of %s not marked revoked: %s", task_id, exc)


def retry(rt: Runtime, selection: Selection, dry_run: bool = False) -> ActionReport:
    """Run ended work (failed, ignored, revoked, expired, cancelled, dead) again with its
    task id: re-queued with its counters reset and its revocation tombstone deleted, then its
    stored message is sent again without its ``expires`` (an operator's retry overrides the
    caller's deadline; an expired message would otherwise expire again at once)."""
    unsent: list[tuple[str, str]] = []

    def publish(batch: Sequence[Target]) -> None:
        sent: set[str] = set()
        try:
            with rt.app.connection_for_write() as broker:
                for t in batch:
                    _publish_retried(rt, broker, t, unsent)
                    sent.add(t.work_key)
        except Exception as exc:  # the broker connection itself failed
            unsent.extend((t.work_key, f"{type(exc).__name__}: {exc}") for t in batch
                          if t.work_key not in sent)

    report = rt.store.operator.retry(
        selection, rt.config.submit_timeout, dry_run, rewrite=without_expiry,
        on_batch=publish)
    return replace(report, unsent=tuple(unsent))


def _publish_retried(rt: Runtime, broker: Any, t: Target,
                     unsent: list[tuple[str, str]]) -> None:
    extra = {"action": "operator_retried", "work_key": t.work_key, "task_id": t.task_id,
             "previous_state": t.previous_state}
    try:
        if t.message_json is None:  # refused before it got here; checked for the types
            raise ValueError("no stored message")
        messages.publish(broker, t.message_json, {messages.REPUBLISHED_HEADER: 1}, rt.app)
    except Exception as exc:
        unsent.append((t.work_key, f"{type(exc).__name__}: {exc}"))
        log.warning("operator retry of %s was recorded but its message was not sent: %s; a "
                    "worker's sweep sends it after resilient_submit_timeout", t.work_key, exc,
                    extra={**extra, "action": "republish_failed"})
        return
    log.info("operator retried work %s (was %s)", t.work_key, t.previous_state, extra=extra)


def forget(rt: Runtime, selection: Selection, dry_run: bool = False) -> ActionReport:
    """Delete ended work with its checkpoint and steps; its ledger markers are kept, so an
    effect it applied is still not applied again."""
    report = rt.store.operator.forget(selection, dry_run)
    if not dry_run:
        for t in report.changed:
            log.info("operator forgot work %s (was %s)", t.work_key, t.previous_state,
                     extra={"action": "operator_forgot", "work_key": t.work_key,
                            "task_id": t.task_id, "previous_state": t.previous_state})
    return report


def without_expiry(message_json: str) -> str:
    """The stored message without its ``expires``.

    Celery discards a delivery whose ``expires`` has passed before it runs, and the work
    would end ``expired`` again; an operator's retry overrides the caller's deadline. It is
    dropped whatever the clock says, so a retry means the same thing every time. A message
    without one is returned unchanged.
    """
    m = json.loads(message_json)
    signature = m.get("signature")
    if isinstance(signature, dict):  # the call form (no delivered bytes were at hand)
        options = signature.get("options")
        if not isinstance(options, dict) or options.pop("expires", None) is None:
            return message_json
    else:
        headers = m.get("headers")
        if not isinstance(headers, dict) or headers.get("expires") is None:
            return message_json
        headers["expires"] = None
    return json.dumps(m)


__all__ = ["ActionReport", "Refusal", "RepublishRefused", "Republished", "Selection",
           "SelectionError", "Target", "cancel", "forget", "republish", "retry",
           "without_expiry"]
