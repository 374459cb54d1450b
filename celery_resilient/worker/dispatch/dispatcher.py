"""The batched takes' coordinator, on Celery's event loop and on a thread of its own.

The event loop submits requests, hears that the pool accepted one, lost one or is done with
one, and asks whether an acknowledgement waits for a flush. The dispatcher's thread
(:mod:`.takes_thread`) makes the statements: batches of takes (:mod:`.taker`), hand-backs of
claims (:mod:`.parking`), bare flushes (:mod:`.acks`) that commit handed results
(:mod:`.group_commit`). The loop wakes the thread with an event; the thread wakes the loop
through a pipe its hub reads, and the loop then hands the taken requests to the pool and
acknowledges what a flush made durable (the broker channel is not thread-safe).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Collection
from typing import Any

from celery_resilient.core import killpoints
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.batched_takes import Started
from celery_resilient.tasks import handed_claims, handed_results
from celery_resilient.worker.dispatch.acks import AckDeferral
from celery_resilient.worker.dispatch.entries import Entry, Execute
from celery_resilient.worker.dispatch.group_commit import GroupCommit
from celery_resilient.worker.dispatch.log import log
from celery_resilient.worker.dispatch.marks import StartMarks
from celery_resilient.worker.dispatch.parking import HandedClaim, KeyParking
from celery_resilient.worker.dispatch.taker import BatchTaker
from celery_resilient.worker.dispatch.takes_thread import TakesThread


class BatchedDispatch:
    """Takes the claims of waiting requests in batches, then hands them to the pool."""

    def __init__(self, rt: Runtime, owner: Owner) -> None:
        self.rt = rt
        self.owner = owner
        self._hub: Any = None
        #: The consumer: its prefetch window (``consumer.qos``, made anew at each connection)
        #: widens by one for each finished request whose acknowledgement waits for a flush.
        self._consumer: Any = None
        #: Bumped when the consumer's connection ends: requests of an earlier one are dropped.
        self._connection = 0
        self._waiting: deque[Entry] = deque()
        self._ready: deque[Entry] = deque()
        lock = threading.Lock()  # the event loop's and the thread's, around keys and marks
        self._parking = KeyParking(lock)
        self._marks = StartMarks(lock)
        self._results = GroupCommit(rt, owner)
        self._acks = AckDeferral(rt, self._results)
        self._wake = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._taker = BatchTaker(rt, owner, self._waiting, self._ready, self._parking,
                                 self._marks, self._results, self._wake_loop)
        self._thread = TakesThread(rt, owner, self._waiting, self._wake, self._parking,
                                  self._marks, self._acks, self._take_batch, self._wake_loop,
                                  self._pool_has_queued)

    @property
    def batches(self) -> int:
        """How many statements of takes were made."""
        return self._taker.batches

    @property
    def _stopping(self) -> bool:
        return self._thread.stopping

    @property
    def _claims(self) -> dict[Any, HandedClaim]:
        """The (work key, epoch) handed with each request, by the request itself."""
        return self._parking.claims

    @property
    def _unstarted(self) -> dict[str, Any]:
        """Work keys of claims handed and not yet started, and the request holding each."""
        return self._parking.unstarted

    # -- the consumer's event loop ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        handed_results.accepting(self._acks.defers)

    def attach(self, hub: Any, consumer: Any = None) -> None:
        """The ``consumer`` (re)started on ``hub``: taken requests are handed on from
        there."""
        self._hub = hub
        self._consumer = consumer
        hub.add_reader(self._read_fd, self._on_ready)

    def detach(self, known: Collection[str] | None) -> None:
        """The consumer stopped (its connection lost, or a shutdown): requests not handed
        on yet are dropped with it, as Celery drops its own; the claims taken for requests
        Celery no longer ``known`` go back for the copies the broker delivers again."""
        self._connection += 1
        if self._hub is not None:
            with contextlib.suppress(Exception):  # the hub may be closed already
                self._hub.remove_reader(self._read_fd)
            self._hub = None
        self._consumer = None
        self._waiting.clear()
        self._ready.clear()
        self._parking.drop_parked()
        # Finished requests (their acks waiting, or their results handed over) are not
        # Celery's any more, but their claims end with their results, not go back.
        finished = self._finished_requests()
        self._acks.drop()  # their delivery tags died with the connection
        if known is not None and self._parking.drop_gone(known, finished):
            self._wake.set()

    def finishing(self) -> frozenset[str]:
        """Work keys whose bodies ended here and whose ends are not settled yet: a result
        handed over and not committed, or an acknowledgement waiting for a flush. Their
        claims still read ``running`` and no request executes them, yet they must not be
        let go (the maintainer's reconcile asks this after reading what executes)."""
        keys = self._results.pending()
        for request in self._acks.waiting():
            claim = self._claims.get(request)
            if claim is not None:
                keys.add(claim[0])
        return frozenset(keys)

    def _finished_requests(self) -> set[Any]:
        """Requests whose acknowledgement waits here, or whose result this process holds."""
        pending = self._results.pending()
        finished = self._acks.waiting()
        finished.update(r for r, claim in list(self._claims.items()) if claim[0] in pending)
        return finished

    def accepts(self) -> bool:
        return not self._stopping and self._hub is not None

    def submit(self, request: Any, execute: Execute) -> None:
        """Instead of ``execute(request)`` (the consumer's hand-off to the pool): the
        request is handed on once its claim is taken."""
        self._waiting.append((request, execute, self._connection))
        self._wake.set()

    def started(self, request: Any, pid: int) -> None:
        """The pool accepted ``request`` (its process ``pid``): mark its claim started;
        requests waiting for its key go on (their own takes find it running here)."""
        claim = self._claims.get(request)
        if claim is not None:
            self._mark(Started(claim[0], claim[1], pid))
            self._unpark(claim[0], request, to=self._ready)

    def lost(self, request: Any) -> None:
        """The pool process running ``request`` died: its claim loses its owner now, so the
        next take counts a death (whether or not it was marked started yet)."""
        claim = self._claims.pop(request, None)
        if claim is not None:
            self._mark(Started(claim[0], claim[1], None))
            self._unpark(claim[0], request, to=self._waiting)

    def defer_ack(self, request: Any) -> bool:
        """Whether ``request``'s acknowledgement waits for the next flush (its claim was
        handed: its finish did not wait for one); the event loop acknowledges it then."""
        if not self._acks.defers or request not in self._claims:
            return False
        if self._stopping or self._hub is None:
            self._acks.flush_inline()  # no thread to wait for: flush here, then acknowledge
            return False
        self._acks.defer(request, self._connection)
        # A finished request waiting for its flush holds a prefetch slot but no pool
        # process: the window widens by one until it is acknowledged, as Celery widens it
        # for a request waiting for its ETA, so the flush's latency does not starve the pool.
        self._widen(+1)
        self._wake.set()
        return True

    def forget(self, request: Any) -> None:
        """``request`` was acknowledged or rejected: nothing more to mark for it. If its pool
        never started it (Celery discarded it: revoked, expired), its claim goes back first,
        then the requests waiting for its key are taken."""
        if self._parking.forget(request):
            self._wake.set()

    def _widen(self, by: int) -> None:
        """Widen (narrow) the consumer's prefetch window; Celery's event loop applies it."""
        qos = getattr(self._consumer, "qos", None)
        if qos is not None:
            (qos.increment_eventually if by > 0 else qos.decrement_eventually)(abs(by))

    def _commit_finishes(self) -> bool:
        """Commit the results handed over so far in a statement of their own (see
        :meth:`GroupCommit.commit`)."""
        return self._results.commit()

    def _unpark(self, key: str, holder: Any, to: deque[Entry]) -> None:
        """``holder`` no longer holds ``key`` unstarted: its waiters move ``to`` the ready
        queue (their own takes decide) or the waiting one (taken in the next batch)."""
        parked = self._parking.unpark(key, holder)
        for entry in parked:
            handed_claims.hand(entry[0].request_dict, self.owner.incarnation, None)
            to.append(entry)
        if parked:
            self._wake.set()
            self._wake_loop()

    def _mark(self, mark: Started) -> None:
        if self._marks.add(mark):
            self._wake.set()  # the thread times the mark's wait from now

    def _give_back(self, requests: Collection[Any]) -> None:
        """Hand back the claims of requests that will not run here; requests waiting for
        their keys are taken once that is done."""
        if self._parking.give_back(requests):
            self._wake.set()

    def _wake_loop(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake is pending already
            os.write(self._write_fd, b"!")

    def _on_ready(self, *_: Any) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 4096):
                pass
        self._ack_flushed()
        while self._ready:
            request, execute, connection = self._ready.popleft()
            if connection != self._connection or self._stopping:
                # its connection is gone (the broker delivers it again), or the worker stops
                self._give_back([request])
                continue
            try:
                execute(request)
            except Exception:
                log.exception("could not hand %s to the pool", request.id)

    def _ack_flushed(self) -> None:
        """Acknowledge the requests whose results a flush made durable (on the event
        loop's thread: the channel is not thread-safe)."""
        for request, connection in self._acks.take_flushed():
            if connection == self._connection:
                if killpoints.ARMED:
                    self._results.before_ack(self._claims.get(request))
                request.acknowledge_now()
                self._widen(-1)

    # -- the consumer's stop, and the thread's parts ------------------------------------

    def stop(self) -> None:
        """No more batched takes (warm shutdown): what was not handed on stays unacked and
        the broker restores it; its claims go back at the stop (``mark_stopped``). Results
        that come in from now on are flushed by the caller before their acknowledgement."""
        if self._stopping:
            return
        handed_results.accepting(False)  # results from now on: their pool processes finish them
        self._thread.stop()
        self._acks.flush_at_stop()  # results handed over, and acknowledgements waiting for them
        # The event loop reads the pipe no more: what was flushed is acknowledged here
        # (Celery stops its steps on the loop's own thread), not left for the broker to
        # deliver again as a copy of finished work.
        try:
            self._ack_flushed()
        except Exception as exc:  # a connection already closed: the broker delivers them
            log.warning("could not acknowledge %d flushed result(s) at the stop (%s: %s)",
                        len(self._acks.flushed) + 1, type(exc).__name__, exc)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _pool_has_queued(self) -> bool:
        """Whether every pool process has a taken request queued for it (then deliveries
        may gather for a batch: none idles meanwhile)."""
        processes = getattr(getattr(self._consumer, "pool", None), "num_processes", None)
        if not isinstance(processes, int) or processes <= 0:
            return False
        return self._parking.unstarted_count() >= processes

    def _take_batch(self) -> bool:
        """One statement of takes and marks (see :meth:`BatchTaker.take_batch`)."""
        return self._taker.take_batch()

    def _release_claims(self) -> None:
        """Hand back the claims of requests that will not run here (the thread's step)."""
        self._thread.release_claims()
