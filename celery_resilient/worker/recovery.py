"""The sweep that takes back orphaned work and re-publishes it with the same task id.

Runs at worker start and every ``resilient_sweep_interval``. An orphan is an open claim whose
owner is gone: its worker incarnation stopped or was proven dead (taken at once), its
incarnation's lease expired, or it has no owner and its hold expired. It is re-published
from the stored message whatever the broker; a copy the broker also
redelivers later finds the work held or done and runs nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery_resilient import signals
from celery_resilient.broker.generation import BrokerMarker
from celery_resilient.core import messages
from celery_resilient.core.identity import Owner
from celery_resilient.core.states import DEAD, REQUEUED, REVOKED
from celery_resilient.errors import ResilientError, WorkDead
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.sql import Ended, Orphan
from celery_resilient.worker.holding_sweep import HoldingSweep

log = logging.getLogger(__name__)


#: Seconds a sweep waits for the broker before it leaves its orphans for the next round.
BROKER_TIMEOUT = 2.0


def give_back_held(rt: Runtime, holding: HoldingSweep, judge_leases: bool) -> None:
    """The broker half of a sweep alone: what gone incarnations hold goes back to the front
    of its queues (a starting worker, before its consumer fetches)."""
    with rt.app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT)
        _give_back(conn, holding, judge_leases)


def _give_back(conn: Any, holding: HoldingSweep, judge_leases: bool) -> None:
    try:
        holding.run(conn, judge_leases)
    except ResilientError:
        raise
    except Exception as exc:  # the broker went away meanwhile: the next round
        log.warning("could not give back held messages (%s); the next sweep tries again",
                    exc, extra={"action": "holding_restore_failed"})


def sweep(rt: Runtime, owner: Owner, judge_leases: bool = True,
          holding: HoldingSweep | None = None,
          reachable: Callable[[bool], None] | None = None,
          marker: BrokerMarker | None = None) -> list[Orphan]:
    """One recovery round; returns the orphans it re-published (or found back in the
    broker's queue).

    The broker is checked first, with a timeout: while it is unreachable no orphan is
    claimed (their re-publish counts and holds stay as they are), and one that fails to
    send is handed back to the next round without counting as re-published. On Redis the
    holdings of gone workers go back to their queues first (``holding``); an orphan whose
    message went back that way is not published a second time. ``reachable`` hears whether
    the broker answered. With ``marker``, a broker found to have lost its data gets the
    work the store holds for it in this very round (:func:`resend_lost`).
    """
    cfg = rt.config
    with rt.app.connection_for_write() as conn:
        try:
            conn.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT)
        except Exception as exc:
            log.warning("broker unreachable (%s); orphans wait for the next sweep", exc,
                        extra={"action": "republish_failed"})
            if reachable is not None:
                reachable(False)
            return []
        if reachable is not None:
            reachable(True)
        if marker is not None:
            resend_lost(rt, conn, marker)
        if holding is not None:
            _give_back(conn, holding, judge_leases)
        ended: list[Ended] = []
        orphans = rt.store.claim_orphans(owner, cfg.sweep_batch, cfg.submit_timeout,
                                         cfg.max_republish, cfg.republish_backoff_max, ended,
                                         cfg.lease_seconds, judge_leases)
        for e in ended:
            report_ended(rt, e)
        sent: list[Orphan] = []
        unsent: list[str] = []
        for i, orphan in enumerate(orphans):
            extra = {"action": "recovered", "work_key": orphan.work_key,
                     "task_id": orphan.task_id, "previous_state": orphan.previous_state,
                     "previous_owner": orphan.previous_owner}
            if holding is not None and holding.restored_recently(orphan.task_id):
                log.info("orphaned work %s (was %s%s) is back in its queue: its message "
                         "was in the dead worker's holding", orphan.work_key,
                         orphan.previous_state, f" on {orphan.previous_owner}"
                         if orphan.previous_owner else ", no owner", extra=extra)
                _recovered(rt, orphan)
                sent.append(orphan)
                continue
            why = messages.unpublishable(orphan.message_json, rt.app)
            if why is not None:
                unrecoverable(rt, orphan, why, extra)
                continue
            assert orphan.message_json is not None  # unpublishable() said why if it were
            try:
                messages.publish(conn, orphan.message_json, {messages.REPUBLISHED_HEADER: 1},
                                 rt.app, retries=orphan.retries)
            except Exception as exc:
                # The broker went away mid-batch: the rest waits for the next round.
                unsent = [o.work_key for o in orphans[i:] if o.message_json is not None]
                log.warning("re-publish of %s failed (%s); %d orphan(s) wait for the next "
                            "sweep", orphan.work_key, exc, len(unsent),
                            extra={**extra, "action": "republish_failed"})
                break
            log.info("re-published orphaned work %s (was %s%s)", orphan.work_key,
                     orphan.previous_state, f" on {orphan.previous_owner}"
                     if orphan.previous_owner else ", no owner", extra=extra)
            _recovered(rt, orphan)
            sent.append(orphan)
    if unsent:
        rt.store.unsend(unsent, cfg.submit_timeout)
    return sent


def first_look(rt: Runtime, marker: BrokerMarker) -> None:
    """At a worker's start, before it registers: read the broker's token
    (:meth:`BrokerMarker.read_broker_token`), which its broker identity carries. A broker
    that does not answer is left to the first sweep."""
    try:
        with rt.app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=BROKER_TIMEOUT)
            marker.read_broker_token(conn.default_channel)
    except Exception as exc:
        log.warning("could not read the broker's token at start (%s); the first sweep does",
                    exc, extra={"action": "broker_token_unread"})


def resend_lost(rt: Runtime, conn: Any, marker: BrokerMarker) -> None:
    """A broker that lost its data (:mod:`celery_resilient.broker.generation`): what the
    store holds for it is made due, and this sweep's orphans send it. The marker is set
    again only after the store heard: a store that fails here leaves it for the next round."""
    channel = conn.default_channel
    marker.read_broker_token(channel)
    if not marker.missing(channel):
        return
    due = rt.store.broker_lost(rt.config.submit_timeout)
    lived_through = marker.lost_since_seen()
    marker.mark(channel)
    if lived_through or due:
        log.warning("the broker lost its data (its marker is gone: restarted without "
                    "persistence, flushed, or failed over to a replica without it): %d "
                    "queued resumable work(s) the store holds are re-sent now; work sent "
                    "without durable submit is lost with it, as in Celery", due,
                    extra={"action": "broker_data_lost", "count": due})


def _recovered(rt: Runtime, orphan: Orphan) -> None:
    signals.send(signals.work_recovered, rt.app, orphan.task_name, work_key=orphan.work_key,
                 task_id=orphan.task_id, previous_state=orphan.previous_state,
                 previous_owner=orphan.previous_owner)


def unrecoverable(rt: Runtime, orphan: Orphan, why: str, extra: Mapping[str, object]) -> None:
    """An orphan whose stored message cannot be sent (none was kept, or it cannot be
    decoded here): it ends ``dead`` once, with the reason, instead of being swept for ever.

    Not at the first sweep that finds it: its delivery was never acknowledged, so the broker
    may still bring it back (RabbitMQ does at once when the dead worker's connection drops);
    the sweep has just re-queued it with a hold, and that copy takes it. The sweep that finds
    it still re-queued when the hold expired ends it.
    """
    if orphan.previous_state != REQUEUED:
        log.warning("orphan %s cannot be re-published (%s); it ends dead unless the broker "
                    "delivers it again before its hold expires", orphan.work_key, why,
                    extra={**extra, "action": "unrecoverable"})
        return
    reason = f"its owner died and it cannot be re-published: {why}"
    try:
        ended = rt.store.park_unsendable(orphan.work_key, reason)
    except ResilientError as exc:  # the store went away: the next sweep ends it
        log.warning("could not end unrecoverable work %s: %s", orphan.work_key, exc,
                    extra={**extra, "action": "unrecoverable"})
        return
    if ended:  # 0: a delivery of its own took it meanwhile
        report_ended(rt, Ended(orphan.work_key, orphan.task_id, orphan.task_name, DEAD, reason))


def report_ended(rt: Runtime, e: Ended) -> None:
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
