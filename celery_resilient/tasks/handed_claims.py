"""A claim taken by the worker's main process, handed to the pool process with its request.

The main process writes it into the request dict it sends to the pool process
(``resilient_claim``); Celery makes every key of that dict an attribute of the task's
request. A pool process trusts a handed claim only when it names its own worker
incarnation, the work key it derives itself and the current generation (below), while its
worker's lease is surely its own (a worker frozen past its lease may have lost every claim
it handed), and takes it off the request as it reads it: Celery re-sends a request's
unknown keys as headers of a retry, and a header of that name on a message (such a retry,
a re-published copy, a hand-crafted message) never stands in for a take.
"""

from __future__ import annotations

import mmap
import struct
import time
from typing import Any

from celery_resilient.store.sql import Claim, Resume

#: The request attribute (and request-dict key) carrying the handed claim.
FIELD = "resilient_claim"

#: Shared with the pool processes (anonymous shared memory mapped at import, in the worker's
#: main process before the pool forks, as ``core.handoff`` does): the generation of handed
#: claims (a claim handed in an earlier one is void, and its pool process makes its own take
#: instead), and until when (monotonic clock) this worker's lease is surely its own.
_shared = mmap.mmap(-1, 16)


def generation() -> int:
    return int(struct.unpack_from("q", _shared, 0)[0])


def void_all() -> None:
    """Void every claim handed so far: the worker let go of them (its broker was lost), or
    they may have been taken over (it fenced itself, or its lease lapsed)."""
    struct.pack_into("q", _shared, 0, generation() + 1)


def lease_good_until(deadline: float) -> None:
    """The worker's lease keeper: until ``deadline`` (``time.monotonic()``) no other worker
    can have taken this worker's claims (its last renewal plus ``fence_after``)."""
    struct.pack_into("d", _shared, 8, deadline)


def still_own(since: int | None) -> bool:
    """Whether a claim received in generation ``since`` surely is still this worker's: no
    claim was voided since, and the lease is good."""
    return since is not None and since == generation() and _lease_good()


def _lease_good() -> bool:
    return time.monotonic() < float(struct.unpack_from("d", _shared, 8)[0])


def hand(request_dict: dict[str, Any], incarnation: str, claim: Claim | None) -> None:
    """Put ``claim`` (or nothing: the pool process takes its own) into ``request_dict``."""
    if claim is None:
        request_dict.pop(FIELD, None)
        return
    resume = claim.resume.found if claim.resume is not None else None
    request_dict[FIELD] = [incarnation, claim.work_key, claim.epoch, claim.attempts,
                           claim.deaths, None if resume is None else list(resume),
                           generation()]


def received(request: Any, incarnation: str, work_key: str) -> Claim | None:
    """The claim handed with ``request`` (a task's request context) for ``work_key`` by
    this incarnation, if any; taken off the request either way."""
    value = request.__dict__.pop(FIELD, None)
    if isinstance(request.headers, dict):
        request.headers.pop(FIELD, None)
    if not isinstance(value, list) or len(value) != 7:
        return None
    inc, key, epoch, attempts, deaths, resume, handed_in = value
    if inc != incarnation or key != work_key or handed_in != generation():
        return None
    if not _lease_good():  # frozen past its lease, or not renewing: another may own it now
        return None
    found = (str(resume[0]), int(resume[1])) if resume else None
    return Claim(work_key, int(epoch), int(attempts), int(deaths), Resume(found))
