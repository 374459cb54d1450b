"""A claim handed to the pool process with its request (tasks/handed_claims.py): when it is
trusted."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from celery.app.task import Context

from celery_resilient.store.sql import Claim, Resume
from celery_resilient.tasks import handed_claims

INC = "incarnation-a"


@pytest.fixture(autouse=True)
def lease_renewed() -> Iterator[None]:
    """As in a worker whose lease keeper just renewed its lease."""
    handed_claims.lease_good_until(time.monotonic() + 60)
    yield
    handed_claims.lease_good_until(0.0)


def request_with(claim: Claim | None, incarnation: str = INC) -> Context:
    """A task's request context as the pool process builds it from the request dict."""
    request_dict: dict[str, object] = {"id": "t1", "task": "proj.task"}
    handed_claims.hand(request_dict, incarnation, claim)
    return Context(request_dict)


def test_a_claim_of_this_incarnation_and_key_is_received_with_its_checkpoint() -> None:
    claim = Claim("k", 7, 2, 1, Resume(('{"row": 3}', 4)))
    got = handed_claims.received(request_with(claim), INC, "k")
    assert got is not None
    assert (got.work_key, got.epoch, got.attempts, got.deaths) == ("k", 7, 2, 1)
    assert got.resume is not None and got.resume.found == ('{"row": 3}', 4)
    nothing = handed_claims.received(request_with(Claim("k", 1, 1, 0, Resume(None))), INC, "k")
    assert nothing is not None and nothing.resume is not None and nothing.resume.found is None


def test_a_claim_is_refused_for_another_incarnation_or_key() -> None:
    claim = Claim("k", 7, 1, 0, Resume(None))
    assert handed_claims.received(request_with(claim, "incarnation-b"), INC, "k") is None
    assert handed_claims.received(request_with(claim), INC, "other-key") is None


def test_a_claim_is_taken_off_the_request_so_a_retry_never_carries_it() -> None:
    request = request_with(Claim("k", 7, 1, 0, Resume(None)))
    assert handed_claims.FIELD in (request.headers or {}), "Celery re-sends unknown keys as headers"
    assert handed_claims.received(request, INC, "k") is not None
    assert handed_claims.FIELD not in request.__dict__
    assert handed_claims.FIELD not in (request.headers or {})
    assert handed_claims.received(request, INC, "k") is None, "read once"


def test_claims_handed_before_void_all_are_void() -> None:
    request = request_with(Claim("k", 7, 1, 0, Resume(None)))
    handed_claims.void_all()
    assert handed_claims.received(request, INC, "k") is None
    fresh = request_with(Claim("k", 8, 1, 0, Resume(None)))
    got = handed_claims.received(fresh, INC, "k")
    assert got is not None and got.epoch == 8


def test_no_claim_and_malformed_values_are_not_claims() -> None:
    assert handed_claims.received(request_with(None), INC, "k") is None
    for value in ("x", [INC, "k", 1], {"epoch": 1}, None):
        request = Context({"id": "t1", handed_claims.FIELD: value})
        assert handed_claims.received(request, INC, "k") is None


def test_a_claim_is_refused_once_the_lease_may_have_lapsed() -> None:
    """A worker frozen past its lease (or no longer renewing it) may have lost every claim it
    handed: the pool process takes its own instead."""
    request = request_with(Claim("k", 7, 1, 0, Resume(None)))
    handed_claims.lease_good_until(time.monotonic() - 0.001)
    assert handed_claims.received(request, INC, "k") is None
