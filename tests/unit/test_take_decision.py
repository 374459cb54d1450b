"""The take's decision (core/take.py), without a database: every rule and their precedence."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from celery_resilient.core.states import (
    CANCELLED,
    DEAD,
    DONE,
    EXPIRED,
    FAILED,
    IGNORED,
    REQUEUED,
    RESERVED,
    REVOKED,
    RUNNING,
    UNSTARTED_PID,
)
from celery_resilient.core.take import (
    Delivery,
    IsLive,
    TakeAction,
    TakeDecision,
    TakeRow,
    decide_take,
    running_elsewhere,
)
from celery_resilient.errors import WorkKeyConflict
from celery_resilient.store import records

ME, OTHER = "inc-me", "inc-other"
ROW = TakeRow(state=REQUEUED, task_id="t1", args_digest="d", epoch=4, deaths=1, retries=0,
              handed_to=None, owner_node=None, incarnation=None, owner_pid=None, error=None,
              result_json=None, owner_known=False, owner_live=False, lease_live=False)
ASK = Delivery(work_key="k", task_id="t1", args_digest="d", retries=0, supersedes=None,
               incarnation=ME, revoked=False)
RUNNING_HERE = replace(ROW, state=RUNNING, owner_node="me@host", incarnation=ME, owner_pid=42)
RUNNING_THERE = replace(ROW, state=RUNNING, owner_node="other@host", incarnation=OTHER,
                        owner_pid=7, owner_known=True, owner_live=True)


def never_asked(node: str | None, incarnation: str | None, pid: int | None) -> bool:
    raise AssertionError(f"is_live asked about {node} {incarnation} {pid}")


def answers(alive: bool) -> tuple[IsLive, list[tuple[str | None, str | None, int | None]]]:
    asked: list[tuple[str | None, str | None, int | None]] = []

    def is_live(node: str | None, incarnation: str | None, pid: int | None) -> bool:
        asked.append((node, incarnation, pid))
        return alive

    return is_live, asked


def decide(row: TakeRow | None, is_live: IsLive = never_asked, max_attempts: int = 5,
           **delivery: Any) -> TakeDecision:
    return decide_take(row, replace(ASK, **delivery), max_attempts, is_live)


def test_take_action_is_still_importable_from_the_store_records() -> None:
    assert records.TakeAction is TakeAction


# -- a key with no row --------------------------------------------------------------------


def test_a_new_key_runs() -> None:
    assert decide(None) == TakeDecision(TakeAction.RUN)


def test_a_new_key_of_a_revoked_request_is_written_revoked() -> None:
    assert decide(None, revoked=True) == TakeDecision(TakeAction.STOPPED, reason=REVOKED,
                                                      end_state=REVOKED)


# -- rules settled by the row alone -------------------------------------------------------


def test_other_arguments_under_the_same_key_conflict() -> None:
    with pytest.raises(WorkKeyConflict, match="work key 'k' was already used by task t1"):
        decide(ROW, args_digest="other")


@pytest.mark.parametrize("mine, stored", [(None, "d"), ("d", None), (None, None), ("", "x")])
def test_a_missing_digest_never_conflicts(mine: str | None, stored: str | None) -> None:
    assert decide(replace(ROW, args_digest=stored), args_digest=mine).action is TakeAction.RUN


def test_a_conflict_outranks_done_and_dead() -> None:
    for state in (DONE, DEAD):
        with pytest.raises(WorkKeyConflict):
            decide(replace(ROW, state=state), args_digest="other")


def test_done_returns_the_stored_result_to_any_request() -> None:
    row = replace(ROW, state=DONE, result_json='{"r": 1}')
    expected = TakeDecision(TakeAction.DONE, result_json='{"r": 1}')
    assert decide(row) == expected
    assert decide(row, task_id="t2", revoked=True, retries=9) == expected


def test_dead_fails_any_request_with_the_reason() -> None:
    assert decide(replace(ROW, state=DEAD, error="why")) == TakeDecision(TakeAction.DEAD,
                                                                          reason="why")
    assert decide(replace(ROW, state=DEAD), task_id="t2", revoked=True) == TakeDecision(
        TakeAction.DEAD, reason="")


@pytest.mark.parametrize("state", [REVOKED, EXPIRED, CANCELLED])
def test_a_stopped_request_stays_stopped(state: str) -> None:
    assert decide(replace(ROW, state=state)) == TakeDecision(TakeAction.STOPPED, reason=state)


def test_a_failed_request_reports_its_failure() -> None:
    row = replace(ROW, state=FAILED, result_json="{exc}", error="boom")
    assert decide(row) == TakeDecision(TakeAction.FAILED, reason="boom", result_json="{exc}")
    assert decide(replace(row, error=None)).reason == "failed"


def test_an_ignored_request_is_a_duplicate() -> None:
    assert decide(replace(ROW, state=IGNORED)) == TakeDecision(
        TakeAction.DUPLICATE, reason="this request already ended (ignored)")


@pytest.mark.parametrize("state", [FAILED, IGNORED, REVOKED, EXPIRED, CANCELLED])
def test_a_new_request_restarts_ended_work_with_a_fresh_crash_count(state: str) -> None:
    assert decide(replace(ROW, state=state, deaths=4), task_id="t2", max_attempts=1) == (
        TakeDecision(TakeAction.RUN, deaths=0))


@pytest.mark.parametrize("state", [RESERVED, REQUEUED, RUNNING])
def test_a_stale_copy_of_an_earlier_try_never_runs(state: str) -> None:
    row = replace(ROW, state=state, retries=2)
    assert decide(row, retries=1) == TakeDecision(
        TakeAction.DUPLICATE, reason="a stale copy of try 1; try 2 holds or held the claim")
    assert decide(replace(row, state=REQUEUED), retries=1, task_id="t2").action is (
        TakeAction.RUN)  # another request's try numbers are its own


def test_a_stale_copy_of_a_running_claim_asks_no_liveness() -> None:
    assert decide(replace(RUNNING_HERE, retries=2), retries=1).action is TakeAction.DUPLICATE


def test_a_stale_copy_outranks_revoked() -> None:
    row = replace(ROW, retries=2)
    assert decide(row, retries=1, revoked=True).action is TakeAction.DUPLICATE


def test_a_later_try_takes_the_claim() -> None:
    assert decide(replace(ROW, retries=1), retries=2) == TakeDecision(TakeAction.RUN, deaths=1)


def test_a_copy_of_a_replaced_request_never_runs() -> None:
    row = replace(ROW, handed_to=4)
    assert decide(row) == TakeDecision(TakeAction.DUPLICATE, reason=(
        "a copy of a request that was replaced at epoch 4; the replacement takes the work"))
    assert decide(row, revoked=True).action is TakeAction.DUPLICATE


def test_the_replacement_takes_a_replaced_request() -> None:
    row = replace(ROW, handed_to=4)
    assert decide(row, supersedes=4) == TakeDecision(TakeAction.RUN, deaths=1)
    assert decide(row, task_id="t2").action is TakeAction.RUN  # another request
    assert decide(replace(row, state=RESERVED)).action is TakeAction.RUN  # only requeued


# -- a running claim ----------------------------------------------------------------------


def test_a_live_execution_of_this_worker_holds_the_claim() -> None:
    is_live, asked = answers(True)
    assert decide(RUNNING_HERE, is_live) == TakeDecision(
        TakeAction.HELD, reason="running on me@host (epoch 4)", held_by=None)
    assert asked == [("me@host", ME, 42)]


def test_a_live_execution_of_another_worker_holds_it_by_that_incarnation() -> None:
    assert decide(RUNNING_THERE) == TakeDecision(
        TakeAction.HELD, reason="running on other@host (epoch 4)", held_by=OTHER)


def test_a_dead_execution_is_taken_over_with_a_death() -> None:
    is_live, asked = answers(False)
    assert decide(RUNNING_HERE, is_live) == TakeDecision(TakeAction.RUN, deaths=2)
    assert asked == [("me@host", ME, 42)]
    assert decide(replace(RUNNING_THERE, owner_live=False)) == TakeDecision(
        TakeAction.RUN, deaths=2)


def test_a_claim_taken_but_not_started_here_is_held_without_asking() -> None:
    row = replace(RUNNING_HERE, owner_pid=UNSTARTED_PID)
    assert decide(row).action is TakeAction.HELD


def test_a_claim_taken_but_never_started_elsewhere_is_taken_over_without_a_death() -> None:
    row = replace(RUNNING_THERE, owner_pid=UNSTARTED_PID, owner_live=False)
    assert decide(row) == TakeDecision(TakeAction.RUN, deaths=1)


def test_the_copy_that_supersedes_the_running_epoch_replaces_it_without_a_death() -> None:
    assert decide(RUNNING_HERE, supersedes=4) == TakeDecision(TakeAction.RUN, deaths=1)
    assert decide(RUNNING_THERE, supersedes=4) == TakeDecision(TakeAction.RUN, deaths=1)


def test_a_held_claim_outranks_revoked_and_the_death_cap() -> None:
    assert decide(RUNNING_THERE, revoked=True, max_attempts=1).action is TakeAction.HELD


def test_a_revoked_request_ends_its_own_open_work() -> None:
    assert decide(ROW, revoked=True) == TakeDecision(
        TakeAction.STOPPED, reason=REVOKED, deaths=1, end_state=REVOKED,
        end_error="revoked by task id")
    assert decide(replace(RUNNING_THERE, owner_live=False), revoked=True) == TakeDecision(
        TakeAction.STOPPED, reason=REVOKED, deaths=2, end_state=REVOKED,
        end_error="revoked by task id")


def test_a_revoked_request_leaves_another_requests_work_alone() -> None:
    decision = decide(ROW, revoked=True, task_id="t2")
    assert decision.action is TakeAction.STOPPED and decision.end_state is None
    decision = decide(replace(ROW, state=FAILED), revoked=True, task_id="t2")
    assert (decision.action, decision.end_state, decision.deaths) == (
        TakeAction.STOPPED, None, 0)


def test_revoked_outranks_too_many_deaths() -> None:
    decision = decide(replace(ROW, deaths=9), revoked=True, max_attempts=1)
    assert (decision.action, decision.end_state, decision.deaths) == (
        TakeAction.STOPPED, REVOKED, 9)


def test_too_many_deaths_park_the_work_dead() -> None:
    reason = "its execution died 3 times (resilient_max_attempts=3)"
    assert decide(replace(RUNNING_THERE, owner_live=False, deaths=2), max_attempts=3) == (
        TakeDecision(TakeAction.DEAD, reason=reason, deaths=3, end_state=DEAD,
                     end_error=reason))
    assert decide(replace(ROW, deaths=2), max_attempts=3).action is TakeAction.RUN


# -- is the recorded execution still running? ---------------------------------------------


def test_a_claim_with_no_owner_runs_nowhere() -> None:
    assert not running_elsewhere(replace(RUNNING_THERE, incarnation=None), ME, never_asked)


def test_another_incarnation_is_judged_by_its_lease_row_or_the_claims_lease() -> None:
    row = replace(RUNNING_THERE, owner_known=True, owner_live=False, lease_live=True)
    assert not running_elsewhere(row, ME, never_asked)
    row = replace(RUNNING_THERE, owner_known=False, owner_live=False, lease_live=True)
    assert running_elsewhere(row, ME, never_asked)
    assert not running_elsewhere(replace(row, lease_live=False), ME, never_asked)


@pytest.mark.parametrize("row", [replace(ROW, state=s) for s in (RESERVED, REQUEUED, DONE,
                                                                   DEAD, FAILED, REVOKED)])
def test_liveness_is_asked_only_of_a_running_claim(row: TakeRow) -> None:
    decide(replace(row, incarnation=ME, owner_pid=42))
