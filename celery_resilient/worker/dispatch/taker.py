"""A batch of takes: the waiting requests sorted, one statement, each request handed on.

The statement takes the claims of the batch's requests, writes the started and lost marks
waiting and commits the results handed over (:meth:`~celery_resilient.store.sql.Store.take_batch`).
Each request then goes to the ready queue with its claim in its request dict, or with none:
its pool process takes its own (the request could not be taken here, or the batch failed).
A request for a key held unstarted by another is parked behind it; a later request for a
key of the same batch (or one whose result the statement commits) goes on after it, to its
own take.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from celery_resilient.core import codec, killpoints, messages, workkey
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.batched_takes import Started, TakeRequest
from celery_resilient.store.sql import Claim
from celery_resilient.tasks import handed_claims
from celery_resilient.tasks.task import SUPERSEDES_HEADER
from celery_resilient.worker.dispatch.entries import Entry
from celery_resilient.worker.dispatch.group_commit import GroupCommit
from celery_resilient.worker.dispatch.log import log
from celery_resilient.worker.dispatch.marks import StartMarks
from celery_resilient.worker.dispatch.parking import KeyParking

#: The most requests one statement takes.
MAX_BATCH = 256
#: The longest deliveries wait to be taken with later ones while every pool process has a
#: taken request queued for it (so none idles meanwhile): a statement's planning and commit
#: are most of its cost in the server, and fewer statements for more deliveries save them.
GATHER_DELAY = 0.003


class BatchTaker:
    """Takes the claims of the requests ``waiting`` in one statement, then readies them."""

    def __init__(self, rt: Runtime, owner: Owner, waiting: deque[Entry], ready: deque[Entry],
                 parking: KeyParking, marks: StartMarks, results: GroupCommit,
                 wake_loop: Callable[[], None]) -> None:
        self.rt = rt
        self.owner = owner
        self._waiting = waiting
        self._ready = ready
        self._parking = parking
        self._marks = marks
        self._results = results
        #: Wakes the event loop, which hands the ready requests on.
        self._wake_loop = wake_loop
        self.batches = 0

    def take_batch(self) -> bool:
        """One statement of takes and marks; whether it took any claim (then it wrote, and
        its commit waited for the WAL flush)."""
        batch: list[Entry] = []
        while self._waiting and len(batch) < MAX_BATCH:
            batch.append(self._waiting.popleft())
        cfg = self.rt.config
        results = self._results
        with results.lock:
            results.collect()
            fins = list(results.finishes.values())
            marks = self._marks.take(superseded=results.finishes)
            takes, keys, later = self._sort(batch)
            held: list[Started] = []
            try:
                claims, finished = self.rt.store.take_batch(
                    takes, marks, self.owner, cfg.lease_seconds, cfg.max_attempts, fins,
                    deferred=held)
                self._marks.defer(held)
            except Exception as exc:  # the results wait for the next statement
                log.warning("batched take of %d request(s) failed (%s: %s); their pool "
                            "processes take their own claims", len(takes), type(exc).__name__,
                            exc, extra={"action": "batch_take_failed"})
                claims, finished, fins = {}, set(), []
            results.committed_now(fins, finished)
        if claims and killpoints.ARMED:
            killpoints.reached("after_batch_take")
        self.batches += 1
        self._hand_on(batch, keys, claims, later)
        return bool(claims) or bool(finished)

    def _sort(self, batch: list[Entry]) -> tuple[list[TakeRequest], list[str | None],
                                                 dict[str, list[Entry]]]:
        """The takes of a batch, and each request's key in it: None, its pool process takes
        the claim; "", it waits (its key is held unstarted for another request, parked; or
        it is a later request for a key of this batch, returned by key)."""
        takes: list[TakeRequest] = []
        keys: list[str | None] = []
        later: dict[str, list[Entry]] = {}
        taken: set[str] = set()
        for entry in batch:
            take = take_request(entry[0])
            if take is None:
                keys.append(None)
                continue
            key = take.work_key
            if self._parking.park_if_held(key, entry):
                keys.append("")
                continue
            if key in taken or key in self._results.finishes:
                # a later request for a key of this batch, or for one whose result this
                # batch commits: it goes on after it, to its own take
                later.setdefault(key, []).append(entry)
                keys.append("")
                continue
            taken.add(key)
            takes.append(take)
            keys.append(key)
        return takes, keys, later

    def _hand_on(self, batch: list[Entry], keys: list[str | None],
                 claims: dict[str, Claim], later: dict[str, list[Entry]]) -> None:
        """Each request to the ready queue with its claim (or none); the later requests for
        a key taken here wait for it, the others go on to their own takes."""
        for entry, key in zip(batch, keys, strict=True):
            if key == "":
                continue
            request = entry[0]
            claim = claims.get(key) if key is not None else None
            handed_claims.hand(request.request_dict, self.owner.incarnation, claim)
            if claim is not None and key is not None:
                self._parking.hold(key, request, (claim.work_key, claim.epoch),
                                   later.pop(key, []))
            self._ready.append(entry)
        for waiters in later.values():
            for entry in waiters:
                handed_claims.hand(entry[0].request_dict, self.owner.incarnation, None)
                self._ready.append(entry)
        if batch:
            self._wake_loop()


def take_request(request: Any) -> TakeRequest | None:
    """What the statement needs to take ``request``'s claim; None: its pool process takes
    its own (it reports what made this fail)."""
    try:
        headers = request.request_dict
        key = workkey.derive(request.task, request.id, request.args, request.kwargs,
                             headers)
        supersedes = headers.get(SUPERSEDES_HEADER)
        return TakeRequest(
            key, request.task.name, request.id, int(headers.get("retries") or 0),
            int(supersedes) if supersedes is not None else None,
            codec.args_digest(request.args, request.kwargs),
            messages.from_kombu(request.message))
    except Exception as exc:  # the pool process's own take reports it
        log.debug("request %s left to its pool process's take: %s", request.id, exc)
        return None
