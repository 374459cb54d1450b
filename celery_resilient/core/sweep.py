"""What the sweeps decide per claim, from the rows as read: pure, no store.

The store selects the rows (locked), classifies them here, then applies the result; the
rules read as one table each and are tested without a database.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from celery_resilient.core.states import DEAD, RESERVED, REVOKED, RUNNING, UNSTARTED_PID


@dataclass(frozen=True)
class OwnClaim:
    """A running or reserved claim of the reconciling incarnation."""

    work_key: str
    task_id: str
    state: str
    epoch: int
    owner_pid: int | None
    #: Untouched for the grace period (a take lands before its pool reports it started).
    quiet: bool


@dataclass(frozen=True)
class Reconciled:
    """The claims a reconcile gives up: ``lapse`` loses its owner (the next sweep
    re-publishes it), ``let_go`` goes back to ``requeued`` after its hold, without a death."""

    lapse: list[tuple[str, int, str]] = field(default_factory=list)  # key, epoch, why
    let_go: list[tuple[str, int, float]] = field(default_factory=list)  # key, epoch, hold


def reconcile_claims(
    claims: Iterable[OwnClaim], own_pid: int, pid_alive: Callable[[int | None], bool] | None,
    held: Collection[str] | None, executing: Collection[str] | None, resent: Collection[str],
    finishing: Collection[str], resend_hold: float,
) -> Reconciled:
    """Which of its claims an incarnation gives up, by the rules of ``Sweeps.reconcile``.

    ``pid_alive`` is asked once per pool process, and only about a running claim that no
    earlier rule settled.
    """
    out = Reconciled()
    dead_pids: dict[int, bool] = {}
    for c in claims:
        if c.work_key in finishing:
            continue  # ended here: its result is on its way to the store
        if c.state == RESERVED:
            if held is not None and c.task_id not in held and c.task_id not in resent:
                out.lapse.append((c.work_key, c.epoch, "its message is no longer held"))
            continue
        pid = c.owner_pid
        if pid == UNSTARTED_PID and (held is None or c.task_id in held):
            continue  # taken for a request it (may) still hold: on its way to the pool
        if pid_alive is not None and pid and pid != own_pid:
            if pid not in dead_pids:
                dead_pids[pid] = not pid_alive(pid)
            if dead_pids[pid]:
                out.lapse.append((c.work_key, c.epoch, f"pool process {pid} is gone"))
                continue
        if executing is not None and c.task_id not in executing and c.quiet:
            out.let_go.append((c.work_key, c.epoch,
                               resend_hold if c.task_id in resent else 0.0))
    return out


@dataclass(frozen=True)
class OrphanFate:
    """What a sweep does with an orphan: end it (``end_state``, with ``reason``), or
    re-publish it and wait ``hold`` seconds for a worker to take it. ``death``: 1 when
    its owner died running it."""

    death: int
    end_state: str | None = None
    reason: str = ""
    hold: float = 0.0


def judge_orphan(state: str, owner_pid: int | None, republished: int, revoked: bool,
                 hold_seconds: float, max_republish: int | None,
                 max_hold_seconds: float | None) -> OrphanFate:
    """A revoked task id ends ``revoked``; ``max_republish`` re-publishes without progress
    park it ``dead``; otherwise the n-th re-publish waits ``hold_seconds * 2**n`` (at most
    ``max_hold_seconds``)."""
    # a claim its worker took but never saw start (batched takes) did not die
    death = 1 if state == RUNNING and owner_pid != UNSTARTED_PID else 0
    if revoked:
        return OrphanFate(death, REVOKED, "revoked by task id; its owner died")
    if max_republish is not None and republished >= max_republish:
        return OrphanFate(death, DEAD, f"re-published {republished} times without progress "
                                       f"(resilient_max_republish={max_republish})")
    hold = hold_seconds * 2 ** min(republished, 30)
    if max_hold_seconds is not None:
        hold = min(hold, max_hold_seconds)
    return OrphanFate(death, hold=hold)
