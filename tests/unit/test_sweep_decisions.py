"""What the sweeps decide per claim (core/sweep.py), without a database."""

from __future__ import annotations

from typing import Any

import pytest

from celery_resilient.core.states import DEAD, REQUEUED, RESERVED, REVOKED, RUNNING, UNSTARTED_PID
from celery_resilient.core.sweep import (
    OrphanFate,
    OwnClaim,
    Reconciled,
    judge_orphan,
    reconcile_claims,
)

ME = 100  # the reconciling main process


def claim(key: str, state: str = RUNNING, pid: int | None = 7, quiet: bool = True,
          task_id: str | None = None) -> OwnClaim:
    return OwnClaim(key, task_id or f"t-{key}", state, 3, pid, quiet)


def reconcile(claims: list[OwnClaim], alive: set[int] | None = None, **kw: Any) -> Reconciled:
    args: dict[str, Any] = {"held": None, "executing": None, "resent": frozenset(),
                            "finishing": frozenset(), "resend_hold": 60.0, **kw}
    pid_alive = None if alive is None else (lambda pid: pid in alive)
    return reconcile_claims(claims, ME, pid_alive, **args)


def test_nothing_is_given_up_without_evidence() -> None:
    assert reconcile([claim("a"), claim("b", RESERVED)]) == Reconciled()


def test_a_reserved_claim_whose_message_is_no_longer_held_lapses() -> None:
    out = reconcile([claim("a", RESERVED), claim("b", RESERVED), claim("c", RESERVED)],
                    held={"t-b"}, resent={"t-c"})
    assert out == Reconciled(lapse=[("a", 3, "its message is no longer held")])


def test_a_claim_of_a_dead_pool_process_lapses_and_each_pid_is_asked_once() -> None:
    asked: list[int | None] = []

    def pid_alive(pid: int | None) -> bool:
        asked.append(pid)
        return pid == 8

    out = reconcile_claims([claim("a"), claim("b"), claim("c", pid=8), claim("d", pid=ME),
                            claim("e", pid=None)], ME, pid_alive, None, None, frozenset(),
                           frozenset(), 60.0)
    assert out.lapse == [("a", 3, "pool process 7 is gone"), ("b", 3, "pool process 7 is gone")]
    assert asked == [7, 8]


def test_a_claim_taken_for_a_held_request_is_left_alone_without_asking() -> None:
    unstarted = claim("a", pid=UNSTARTED_PID)
    assert reconcile([unstarted], alive=set(), executing=set()) == Reconciled()
    assert reconcile([unstarted], alive=set(), held={"t-a"}, executing=set()) == Reconciled()
    assert reconcile([unstarted], alive=set(), held=set(), executing=set()) == Reconciled(
        let_go=[("a", 3, 0.0)])


def test_a_quiet_claim_not_executing_here_is_let_go_a_resent_one_after_its_hold() -> None:
    out = reconcile([claim("a"), claim("b"), claim("c", quiet=False), claim("d")],
                    alive={7}, executing={"t-d"}, resent={"t-b"})
    assert out == Reconciled(let_go=[("a", 3, 0.0), ("b", 3, 60.0)])


def test_finishing_claims_are_left_alone() -> None:
    out = reconcile([claim("a"), claim("b", RESERVED)], alive=set(), held=set(),
                    executing=set(), finishing={"a", "b"})
    assert out == Reconciled()


def test_a_revoked_orphan_ends_revoked_first() -> None:
    assert judge_orphan(RUNNING, 7, 99, True, 10, 3, None) == OrphanFate(
        1, REVOKED, "revoked by task id; its owner died")


@pytest.mark.parametrize("state, pid, death", [
    (RUNNING, 7, 1), (RUNNING, UNSTARTED_PID, 0), (RESERVED, 7, 0), (REQUEUED, None, 0)])
def test_only_an_orphan_that_died_running_counts_a_death(state: str, pid: int | None,
                                                         death: int) -> None:
    assert judge_orphan(state, pid, 0, False, 10, None, None).death == death


def test_too_many_republishes_park_the_orphan_dead() -> None:
    assert judge_orphan(REQUEUED, None, 3, False, 10, 3, None) == OrphanFate(
        0, DEAD, "re-published 3 times without progress (resilient_max_republish=3)")
    assert judge_orphan(REQUEUED, None, 2, False, 10, 3, None).end_state is None


def test_the_hold_doubles_with_each_republish_up_to_its_cap() -> None:
    holds = [judge_orphan(REQUEUED, None, n, False, 10, None, 35).hold for n in range(4)]
    assert holds == [10, 20, 35, 35]
    assert judge_orphan(REQUEUED, None, 40, False, 1, None, None).hold == 2 ** 30
