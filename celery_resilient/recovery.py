"""The sweep that takes back orphaned work and re-publishes it with the same task id.

Runs at worker start and every ``resilient_sweep_interval``. An orphan is a claim of one of
this node's earlier incarnations (taken at once) or any open claim whose lease expired. It
is re-published from the stored message whatever the broker; a copy the broker also
redelivers later finds the work held or done and runs nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import messages, signals
from .errors import WorkDead
from .states import REVOKED
from .store.sql import Ended, Orphan, Owner

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)
REPUBLISHED_HEADER = "resilient_republished"


def sweep(rt: Resilient, owner: Owner) -> list[Orphan]:
    """One recovery round; returns the orphans it re-published."""
    cfg = rt.config
    ended: list[Ended] = []
    orphans = rt.store.claim_orphans(owner, cfg.sweep_batch, cfg.submit_timeout,
                                     cfg.max_republish, cfg.republish_backoff_max, ended)
    for e in ended:
        report_ended(rt, e)
    if not orphans:
        return []
    sent: list[Orphan] = []
    with rt.app.connection_for_write() as conn:
        for orphan in orphans:
            extra = {"action": "recovered", "work_key": orphan.work_key,
                     "task_id": orphan.task_id, "previous_state": orphan.previous_state,
                     "previous_owner": orphan.previous_owner}
            if orphan.message_json is None:
                log.error("orphan %s has no stored message; it cannot be re-published",
                          orphan.work_key, extra={**extra, "action": "unrecoverable"})
                continue
            try:
                messages.publish(conn, orphan.message_json, {REPUBLISHED_HEADER: 1}, rt.app,
                                 retries=orphan.retries)
            except Exception as exc:
                # The row keeps a lease of submit_timeout: a later sweep sends it again.
                log.warning("re-publish of %s failed: %s", orphan.work_key, exc,
                            extra={**extra, "action": "republish_failed"})
                continue
            log.info("re-published orphaned work %s (was %s on %s)", orphan.work_key,
                     orphan.previous_state, orphan.previous_owner, extra=extra)
            signals.send(signals.work_recovered, rt.app, orphan.task_name,
                         work_key=orphan.work_key, task_id=orphan.task_id,
                         previous_state=orphan.previous_state,
                         previous_owner=orphan.previous_owner)
            sent.append(orphan)
    return sent


def report_ended(rt: Resilient, e: Ended) -> None:
    """Tell the caller: its owner died, so nobody else writes this request's result."""
    log.warning("work %s ended %s instead of being re-published: %s", e.work_key, e.state,
                e.reason, extra={"action": f"work_{e.state}", "work_key": e.work_key,
                                 "task_id": e.task_id})
    try:
        if e.state == REVOKED:
            rt.app.backend.mark_as_revoked(e.task_id, e.reason)
        else:
            rt.app.backend.mark_as_failure(e.task_id, WorkDead(f"work {e.work_key!r} is dead: "
                                                               f"{e.reason}"))
    except Exception as exc:  # no result backend, or it is down: the store has the state
        log.info("result of %s not updated: %s", e.task_id, exc)
