"""Operator actions on single units of work, shared by the Django admin and scripts.

``republish(rt, work_key)`` sends a dead or stuck unit's stored message again, on purpose,
with the same task id and work key. It refuses, with the reason, whatever it cannot re-send
safely or usefully: work running under a live lease (its worker is alive), work already done
(a copy would only return the stored result), work that failed by its own exception (a copy
with the same task id is skipped as a duplicate), and work without a stored message.

The row is changed first, in one transaction that re-checks its state under a row lock; the
message is published after that commits, exactly as the recovery sweep does. If the publish
fails, the row is left ``requeued`` with a lease of ``resilient_submit_timeout``, so a
worker's sweeper sends it again when that runs out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import select, update

from . import messages
from .errors import ResilientError
from .recovery import REPUBLISHED_HEADER
from .states import DEAD, DONE, FAILED, REQUEUED, RUNNING

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)


class RepublishRefused(ResilientError):
    """This work cannot be re-published."""


@dataclass(frozen=True)
class Republished:
    """What ``republish`` did: the work's key, task id, and state and owner before it."""

    work_key: str
    task_id: str
    previous_state: str
    previous_owner: str | None
    deaths_reset: bool


def refusal(state: str, lease_left: float | None, owner: str | None,
            error: str | None, has_message: bool) -> str | None:
    """Why work in this state must not be re-published, or None when it may be.

    ``lease_left`` is seconds until the lease expires by the database's clock (negative when
    it has expired, None when there is none).
    """
    if state == DONE:
        return ("it is already done: its result is stored, and a re-published copy would only "
                "return that result")
    if state == FAILED:
        return (f"it failed by its own exception ({error or 'no error recorded'}); a copy with "
                "the same task id is skipped as a duplicate, so send a new task to run it again")
    if state == RUNNING and lease_left is not None and lease_left > 0:
        return (f"it is running on {owner or 'an unknown worker'} under a live lease "
                f"({lease_left:.0f}s left); it is not stuck. If that worker is gone, its lease "
                "runs out and the recovery sweep re-publishes it")
    if not has_message:
        return ("no broker message is stored for it (it was never received by a worker nor "
                "submitted durably), so there is nothing to re-send")
    return None


def republish(rt: Resilient, work_key: str) -> Republished:
    """Re-send dead or stuck work now; :class:`RepublishRefused` says why when it cannot.

    Dead work gets its death count reset, so the copy runs instead of being parked again;
    its attempts keep counting. A running claim whose lease expired counts one more death,
    as the recovery sweep counts it.
    """
    store = rt.store
    w = store.t.work
    now = store.dialect.now()
    with store.begin() as conn:
        row = conn.execute(
            select(w.c.task_id, w.c.state, w.c.owner_node, w.c.error, w.c.deaths,
                   w.c.message_json, (w.c.lease_expires_at - now).label("lease_left"))
            .where(w.c.work_key == work_key)
            .with_for_update()
        ).first()
        if row is None:
            raise RepublishRefused(f"cannot re-publish {work_key!r}: no such work in the store")
        why = refusal(row.state, row.lease_left, row.owner_node, row.error,
                      row.message_json is not None)
        if why is not None:
            raise RepublishRefused(f"cannot re-publish {work_key!r}: {why}")
        dead = row.state == DEAD
        deaths = 0 if dead else row.deaths + (1 if row.state == RUNNING else 0)
        conn.execute(update(w).where(w.c.work_key == work_key).values(
            state=REQUEUED, owner_node=None, incarnation=None, owner_pid=None,
            lease_expires_at=now + rt.config.submit_timeout, republished=w.c.republished + 1,
            deaths=deaths, error=None if dead else w.c.error, finished_at=None,
            updated_at=now,
        ))
    done = Republished(work_key, row.task_id, row.state, row.owner_node, dead)
    extra = {"action": "operator_republished", "work_key": work_key, "task_id": row.task_id,
             "previous_state": row.state, "previous_owner": row.owner_node}
    try:
        with rt.app.connection_for_write() as broker:
            messages.publish(broker, row.message_json, {REPUBLISHED_HEADER: 1}, rt.app)
    except Exception as exc:
        log.warning("operator re-publish of %s failed: %s; a worker's sweep will send it "
                    "after resilient_submit_timeout", work_key, exc,
                    extra={**extra, "action": "republish_failed"})
        raise
    log.info("operator re-published work %s (was %s on %s)", work_key, row.state,
             row.owner_node, extra=extra)
    return done
