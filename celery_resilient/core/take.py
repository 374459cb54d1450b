"""What a take decides for one delivery, from the work row as read: pure, no store.

The store reads the row (locked) and whether the task id was revoked, asks
:func:`decide_take`, and applies the decision: insert the row, end the work, or take it.
Keeping the rules here makes their order of precedence one readable table, tested without
a database.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from celery_resilient.core.states import (
    DEAD,
    DONE,
    ENDED_BY_REQUEST,
    FAILED,
    OPEN_STATES,
    REQUEUED,
    REVOKED,
    RUNNING,
    STOPPED_STATES,
    UNSTARTED_PID,
)
from celery_resilient.errors import WorkKeyConflict

#: ``is_live(node, incarnation, pid)``: whether an execution of this very worker
#: incarnation is still alive (it asks its own process table).
IsLive = Callable[[str | None, str | None, int | None], bool]


class TakeAction(StrEnum):
    """What a take decided for a delivery (equal to its string, as logs and signals say it)."""

    RUN = "run"
    DONE = "done"
    HELD = "held"
    DEAD = "dead"
    DUPLICATE = "duplicate"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class TakeRow:
    """The facts of a stored work row a take decides on."""

    state: str
    task_id: str
    args_digest: str | None
    epoch: int
    deaths: int
    #: The Celery try that holds or last held the claim.
    retries: int
    #: The epoch a replacement supersedes (``self.replace``): only it takes the work.
    handed_to: int | None
    owner_node: str | None
    incarnation: str | None
    owner_pid: int | None
    error: str | None
    result_json: str | None
    #: Whether a ``workers`` row names the owner incarnation, and whether it holds a lease.
    owner_known: bool
    owner_live: bool
    #: Whether the claim's own lease still runs (on the store's clock).
    lease_live: bool

    @classmethod
    def of(cls, row: Any) -> TakeRow:
        """The facts of a row with the work table's columns, ``owner_known``,
        ``owner_live`` and ``db_now`` (the store's clock)."""
        return cls(row.state, row.task_id, row.args_digest, int(row.epoch), int(row.deaths),
                   int(row.retries), row.handed_to, row.owner_node, row.incarnation,
                   row.owner_pid, row.error, row.result_json, bool(row.owner_known),
                   bool(row.owner_live),
                   row.lease_expires_at is not None and row.lease_expires_at > row.db_now)


@dataclass(frozen=True)
class Delivery:
    """The facts of the delivery that asks to take the work."""

    work_key: str
    task_id: str
    args_digest: str | None
    #: Its Celery try: a copy of an earlier try than the row's never runs.
    retries: int
    #: The epoch a re-sent message was sent to replace (store outage, ``self.replace``).
    supersedes: int | None
    #: The incarnation of the worker taking it.
    incarnation: str
    #: Whether its task id was revoked through Celery.
    revoked: bool


@dataclass(frozen=True)
class TakeDecision:
    """What the take does: the outcome to report, and what to write.

    ``deaths``: the claim's deaths count after this take (written by a run or an end).
    ``end_state``: the terminal state the take writes with ``end_error`` (None: it ends
    nothing). A take of a key with no row writes the row in that state, or running.
    """

    action: TakeAction
    reason: str = ""
    result_json: str | None = None
    held_by: str | None = None
    deaths: int = 0
    end_state: str | None = None
    end_error: str = ""


def decide_take(row: TakeRow | None, delivery: Delivery, max_attempts: int,
                is_live: IsLive) -> TakeDecision:
    """Decide a take: the first rule that applies wins, in the order written here.

    ``row`` None: the key has no row yet. ``is_live`` is asked only about a running claim
    of this incarnation that this delivery does not supersede, as it probes a process.
    Raises :class:`WorkKeyConflict` when the key was used with other arguments.
    """
    d = delivery
    if row is None:
        if d.revoked:
            return TakeDecision(TakeAction.STOPPED, reason=REVOKED, end_state=REVOKED)
        return TakeDecision(TakeAction.RUN)
    if d.args_digest and row.args_digest and d.args_digest != row.args_digest:
        raise WorkKeyConflict(
            f"work key {d.work_key!r} was already used by task {row.task_id} with different "
            "arguments; derive work keys from everything that makes the work distinct"
        )
    if row.state == DONE:
        return TakeDecision(TakeAction.DONE, result_json=row.result_json)
    if row.state == DEAD:
        return TakeDecision(TakeAction.DEAD, reason=row.error or "")
    same_request = row.task_id == d.task_id
    if row.state in ENDED_BY_REQUEST and same_request:
        if row.state in STOPPED_STATES:
            return TakeDecision(TakeAction.STOPPED, reason=row.state)
        if row.state == FAILED:
            return TakeDecision(TakeAction.FAILED, result_json=row.result_json,
                                reason=row.error or "failed")
        return TakeDecision(TakeAction.DUPLICATE,
                            reason=f"this request already ended ({row.state})")
    if row.state in OPEN_STATES and d.retries < row.retries and same_request:
        return TakeDecision(TakeAction.DUPLICATE, reason=(
            f"a stale copy of try {d.retries}; try {row.retries} holds or held the claim"))
    if (row.state == REQUEUED and row.handed_to is not None and d.supersedes != row.handed_to
            and same_request):
        return TakeDecision(TakeAction.DUPLICATE, reason=(
            f"a copy of a request that was replaced at epoch {row.handed_to}; the "
            "replacement takes the work"))
    died = False
    if row.state == RUNNING:
        if row.epoch != d.supersedes and running_elsewhere(row, d.incarnation, is_live):
            other = row.incarnation if row.incarnation != d.incarnation else None
            return TakeDecision(
                TakeAction.HELD, reason=f"running on {row.owner_node} (epoch {row.epoch})",
                held_by=other)
        # A copy re-sent by the execution itself (store outage, retry) replaces it. A
        # claim taken by a main process that died before its pool was seen to start it
        # (store/batched_takes.py) did not die running: no death.
        died = row.epoch != d.supersedes and row.owner_pid != UNSTARTED_PID
    # A new request for a key whose earlier request ended starts a fresh crash count.
    deaths = (0 if row.state in ENDED_BY_REQUEST else row.deaths) + (1 if died else 0)
    if d.revoked:
        # Revoked by id: a copy delivered after a restart, or one this worker never heard
        # the revoke for, runs nothing; the work ends only if it is this request's.
        ends = row.state in OPEN_STATES and same_request
        return TakeDecision(TakeAction.STOPPED, reason=REVOKED, deaths=deaths,
                            end_state=REVOKED if ends else None,
                            end_error="revoked by task id")
    if deaths >= max_attempts:
        reason = f"its execution died {deaths} times (resilient_max_attempts={max_attempts})"
        return TakeDecision(TakeAction.DEAD, reason=reason, deaths=deaths, end_state=DEAD,
                            end_error=reason)
    return TakeDecision(TakeAction.RUN, deaths=deaths)


def running_elsewhere(row: TakeRow, incarnation: str, is_live: IsLive) -> bool:
    """Whether the execution recorded in ``row`` may still be running.

    Judged by liveness, never by name: this ``incarnation`` asks its own process table; a
    lapsed claim (no owner) runs nowhere; another incarnation is live while its lease
    row is (even under the same node name); an owner without a lease row (``apply()``
    outside a worker) is live while the claim's own lease lasts.
    """
    if row.incarnation is None:
        return False
    if row.incarnation == incarnation:
        if row.owner_pid == UNSTARTED_PID:
            return True  # this worker's main process took it for a request it holds
        return is_live(row.owner_node, row.incarnation, row.owner_pid)
    if row.owner_known:
        return row.owner_live
    return row.lease_live
