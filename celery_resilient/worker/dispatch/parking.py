"""Which request holds which claim and work key, and which requests wait for a key.

The claim taken for a request is handed on with it and is known here by the request itself:
copies of one message (a requeue, a re-publish) share a task id but not a claim. While a
handed claim is not started, its request holds the key: other requests for it are parked
until that request started or ended without starting, as if they had both gone to the pool
(whichever starts first runs); handed on earlier, they would find the claim taken for a
request that might never run (a revoked one) and be acknowledged as copies. Claims of
requests that will not run here wait for the dispatcher's thread to hand them back, and the
requests parked behind them go to the next batch after that.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

from celery_resilient.worker.dispatch.entries import Entry

#: A handed claim: its work key and epoch.
HandedClaim = tuple[str, int]


class KeyParking:
    """The claims handed with requests, the keys held unstarted, the requests parked."""

    def __init__(self, lock: threading.Lock) -> None:
        #: The (work key, epoch) handed with each request, by the request itself.
        self.claims: dict[Any, HandedClaim] = {}
        #: Work keys of claims handed and not yet started, and the request holding each.
        self.unstarted: dict[str, Any] = {}
        self.parked: dict[str, list[Entry]] = {}
        #: Claims to hand back, and the requests that were parked behind them.
        self.release: list[HandedClaim] = []
        self.after_release: list[Entry] = []
        #: Shared with the started marks: the event loop and the dispatcher's thread both
        #: change what it guards (all but :attr:`claims`).
        self._lock = lock

    def park_if_held(self, key: str, entry: Entry) -> bool:
        """Park ``entry`` behind the request holding ``key`` unstarted, if one does."""
        with self._lock:
            if key in self.unstarted:
                self.parked.setdefault(key, []).append(entry)
                return True
        return False

    def hold(self, key: str, request: Any, claim: HandedClaim, later: list[Entry]) -> None:
        """``request`` was handed ``claim`` for ``key``: it holds the key until it starts,
        and the ``later`` requests for the key wait behind it."""
        self.claims[request] = claim
        with self._lock:
            self.unstarted[key] = request
            self.parked.setdefault(key, []).extend(later)

    def unpark(self, key: str, holder: Any) -> list[Entry]:
        """``holder`` no longer holds ``key`` unstarted: the requests that waited for it."""
        with self._lock:
            if self.unstarted.get(key) is not holder:
                return []
            del self.unstarted[key]
            return self.parked.pop(key, [])

    def unstarted_count(self) -> int:
        with self._lock:
            return len(self.unstarted)

    def give_back(self, requests: Collection[Any]) -> bool:
        """The claims of requests that will not run here go to :attr:`release`, and the
        requests parked behind them after it; whether any claim did (the thread has work)."""
        claims = [c for c in (self.claims.pop(r, None) for r in requests) if c is not None]
        if not claims:
            return False
        with self._lock:
            self.release.extend(claims)
            for key, _epoch in claims:
                self.unstarted.pop(key, None)
                self.after_release.extend(self.parked.pop(key, []))
        return True

    def to_release(self) -> tuple[list[HandedClaim], list[Entry]]:
        """The claims to hand back now, and the requests to take once that is done."""
        with self._lock:
            claims, self.release = self.release, []
            after, self.after_release = self.after_release, []
        return claims, after

    def forget(self, request: Any) -> bool:
        """``request`` was acknowledged or rejected: if it never started, its claim is given
        back (:meth:`give_back`, whose answer this returns); else it is only forgotten."""
        claim = self.claims.get(request)
        if claim is None:
            return False
        with self._lock:
            never_started = self.unstarted.get(claim[0]) is request
        if never_started:
            return self.give_back([request])
        self.claims.pop(request, None)
        return False

    def drop_parked(self) -> None:
        """The consumer stopped: the requests waiting for keys are dropped with it."""
        with self._lock:
            self.parked.clear()
            self.after_release.clear()

    def drop_gone(self, known: Collection[str], finished: Collection[Any]) -> bool:
        """The requests Celery no longer ``known`` after its consumer stopped: a
        ``finished`` one's claim ends with its result, the others' are given back
        (:meth:`give_back`, whose answer this returns)."""
        gone = [r for r in list(self.claims) if r.id not in known]
        for request in [r for r in gone if r in finished]:
            claim = self.claims.pop(request, None)
            # Celery dropped it before hearing that it started (its pool job was
            # flushed): it holds its key no more, or the copies the broker delivers
            # again would wait behind it for ever
            with self._lock:
                if claim is not None and self.unstarted.get(claim[0]) is request:
                    del self.unstarted[claim[0]]
        return self.give_back([r for r in gone if r not in finished])
