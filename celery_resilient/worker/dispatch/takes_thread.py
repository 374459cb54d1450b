"""The dispatcher's thread: it sleeps until woken or a wait ends, then makes what is due.

In each round, in this order: the claims of dropped requests go back; the waiting requests
are taken, batch after batch, each batch gathering while every pool process has a taken
request queued; started and lost marks that waited :data:`~.marks.STARTED_DELAY` for a batch
get a statement of their own; acknowledgements and results that waited
:data:`~.acks.FLUSH_DELAY` get a bare flush. Every step is bounded by the store deadline.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import deadlines
from celery_resilient.worker.dispatch.acks import AckDeferral
from celery_resilient.worker.dispatch.entries import Entry
from celery_resilient.worker.dispatch.log import log
from celery_resilient.worker.dispatch.marks import STARTED_DELAY, StartMarks
from celery_resilient.worker.dispatch.parking import KeyParking
from celery_resilient.worker.dispatch.taker import GATHER_DELAY, MAX_BATCH


class TakesThread:
    """Runs the dispatcher's statements on a thread of their own (``celery-resilient-takes``)."""

    def __init__(self, rt: Runtime, owner: Owner, waiting: deque[Entry],
                 wake: threading.Event, parking: KeyParking, marks: StartMarks,
                 acks: AckDeferral, take_batch: Callable[[], bool],
                 wake_loop: Callable[[], None], pool_has_queued: Callable[[], bool]) -> None:
        self.rt = rt
        self.owner = owner
        self._waiting = waiting
        #: Set by the event loop when it gave the thread work.
        self._wake = wake
        self._parking = parking
        self._marks = marks
        self._acks = acks
        #: One statement of takes and marks; whether it wrote (the dispatcher's).
        self._take_batch = take_batch
        self._wake_loop = wake_loop
        self._pool_has_queued = pool_has_queued
        self.stopping = False
        self._thread = threading.Thread(target=self._run, name="celery-resilient-takes",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more rounds: the one under way ends (or five seconds pass)."""
        self.stopping = True
        self._wake.set()
        self._thread.join(timeout=5)

    def release_claims(self) -> None:
        """Hand back the claims of requests that will not run here, then let the requests
        that waited for their keys be taken."""
        claims, after = self._parking.to_release()
        try:
            # the broker delivers them again: the sweep waits before it re-publishes them
            self.rt.store.release_unstarted(self.owner, claims,
                                            self.rt.config.submit_timeout)
        except Exception as exc:  # the maintainer lets them go when they are not held
            log.warning("could not hand back %d claim(s) taken for dropped requests (%s: %s)",
                        len(claims), type(exc).__name__, exc)
        self._waiting.extend(after)

    def _pause(self) -> float:
        """How long the thread may sleep: started marks wait for the next batch of takes,
        :data:`STARTED_DELAY` at most, acknowledgements :data:`~.acks.FLUSH_DELAY`; after a
        failed flush, the next try waits a second."""
        if self._acks.failed_at is not None:
            return 1.0
        now = time.monotonic()
        pause = self._acks.flush_in(now)
        if self._marks.waiting():
            pause = min(pause, self._marks.since + STARTED_DELAY - now)
        return max(0.0, pause)

    def _run(self) -> None:
        while not self.stopping:
            self._wake.wait(timeout=self._pause())
            self._wake.clear()
            if self._parking.release:
                self._bounded(self.release_claims)
            while self._waiting and not self.stopping:
                self._gather()
                self._bounded(self._take_and_flush)
            if (self._marks.waiting() and not self.stopping and self._acks.failed_at is None
                    and time.monotonic() >= self._marks.since + STARTED_DELAY):
                self._bounded(self._take_and_flush)
            if self._acks.flush_due():  # no batch of takes covered them in time: a bare flush
                self._bounded(lambda: self._flush_acks(self._acks.deferred, flushed=False))

    def _bounded(self, step: Callable[[], None]) -> None:
        """A silent store fails the step (a batch's pool processes take their own claims),
        it does not hang this thread."""
        with deadlines.bounded(self.rt.config.store_deadline):
            step()

    def _gather(self) -> None:
        """Let deliveries gather for one batch while the pool has work queued: as long as
        each pool process has a taken request waiting for it, up to :data:`GATHER_DELAY`."""
        deadline = time.monotonic() + GATHER_DELAY
        while (not self.stopping and len(self._waiting) < MAX_BATCH
               and self._pool_has_queued()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.wait(timeout=left)
            self._wake.clear()
        if self._parking.release:  # its wake was taken here: the next round hands them back
            self._wake.set()

    def _take_and_flush(self) -> None:
        """A batch of takes; one that wrote waited for the WAL flush, so it covers every
        acknowledgement asked for before it began, handed on at once (a backlog keeps
        this thread taking: acks left for the end of the round waited seconds)."""
        upto = self._acks.deferred
        if self._take_batch() and self._acks.unflushed:
            self._flush_acks(upto, flushed=True)

    def _flush_acks(self, upto: int, flushed: bool) -> None:
        """Hand the waiting acknowledgements numbered up to ``upto`` to the event loop once
        a commit that flushed covered them (see :meth:`AckDeferral.flush`)."""
        if self._acks.flush(upto, flushed):
            self._wake_loop()
