"""Batched takes: the worker's main process claims deliveries before the pool runs them.

Celery hands each request that is to run now to the pool from its event loop
(``consumer.on_task_request``). For a resumable task it comes here instead
(:mod:`celery_resilient.tasks.strategy`): a thread of its own takes the claims of every
request waiting, in one statement (:meth:`~celery_resilient.store.sql.Store.take_batch`),
and the event loop then hands each request on with its claim in the request dict
(:mod:`celery_resilient.tasks.handed_claims`). Requests are taken as they arrive, prefetched ones
too, so a pool process that frees up starts the next body at once, with no round trip of
its own; while one batch commits, the next gathers.

The same statement marks claims started when the pool accepted their request (the pool
process's PID becomes the claim's ``owner_pid``), and clears the owner of a claim whose pool
process died running it (the next take counts the death). A claim taken here and never
marked was never known to start: a takeover after this worker died counts no death for it.

The pool process finishes a handed claim without waiting for the WAL flush (PostgreSQL), and
its acknowledgement waits here instead, for a commit of this thread's that does wait (the
next batch of takes, or a bare flush): one flush for many results, each durable before its
ack all the same. A worker SIGKILLed in between leaves the message unacknowledged (the copy
finds the work done); only a database crash can lose such a finish, and then the claim is
still open and is re-published from the store (docs/reliability.md).

A batch that fails (store unreachable, any error) goes on without claims: each pool process
then takes its own on the careful path, with its store-outage handling. When the consumer
loses its broker connection Celery drops the requests it had not handed to the pool; so does
this dispatcher, and the claims it took for them go back to ``requeued`` (no death), for the
copies the broker delivers again.

Only prefork pools on Celery's event loop get this; other pools keep the take in the task.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from celery_resilient.core import codec, killpoints, messages, workkey
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import deadlines
from celery_resilient.store.batched_takes import Finish, Started, TakeRequest
from celery_resilient.store.sql import Claim
from celery_resilient.tasks import handed_claims, handed_results
from celery_resilient.tasks.task import SUPERSEDES_HEADER

log = logging.getLogger(__name__)
#: The most requests one statement takes.
MAX_BATCH = 256
#: The longest a started mark waits for a batch of takes to travel with.
STARTED_DELAY = 0.05
#: The longest an acknowledgement waits for a batch of takes to flush it before a bare flush
#: does: under a stream of work the next delivery comes within it (the window widens for
#: each waiting ack), and its batch's commit makes the result durable without a flush of
#: its own (one WAL flush instead of two).
FLUSH_DELAY = 0.005
#: The longest deliveries wait to be taken with later ones while every pool process has a
#: taken request queued for it (so none idles meanwhile): a statement's planning and commit
#: are most of its cost in the server, and fewer statements for more deliveries save them.
GATHER_DELAY = 0.003

Execute = Callable[[Any], None]
#: A request waiting here: the request, how to hand it to the pool, its connection's number.
Entry = tuple[Any, Execute, int]


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
        #: Started and lost marks by claim: one per claim and statement (a death replaces a
        #: start not yet written).
        self._marks: dict[tuple[str, int], Started] = {}
        self._marks_since = 0.0
        self._release: list[tuple[str, int]] = []
        #: Requests whose acknowledgement waits for a flush, and those flushed, with the
        #: consumer connection they came on.
        self._unflushed: deque[tuple[Any, int, int]] = deque()
        self._flushed: deque[tuple[Any, int, int]] = deque()
        #: How many acknowledgements were ever deferred: each waiting one carries its
        #: number, so a commit covers exactly those asked for before it began.
        self._deferred = 0
        #: When the oldest acknowledgement not yet covered by a commit was asked for.
        self._unflushed_since = 0.0
        self._flush_failed_at: float | None = None
        self._defers = not rt.store.dialect.is_sqlite
        #: Results pool processes handed over (``tasks/handed_results.py``), by work key, until a
        #: statement commits them (each batch carries all of them).
        self._reader = handed_results.Reader()
        self._finishes: dict[str, Finish] = {}
        self._finish_lock = threading.Lock()
        self._finishes_since = 0.0
        #: Keys group-committed whose acknowledgement is still due (kill points only).
        self._committed: set[str] = set()
        #: The (work key, epoch) handed with each request, by the request itself: copies of
        #: one message (a requeue, a re-publish) share a task id but not a claim.
        self._claims: dict[Any, tuple[str, int]] = {}
        #: Work keys of claims handed and not yet started, and the task id holding each;
        #: other requests for such a key wait (``_parked``) until that request started or
        #: ended without starting, as if they had both gone to the pool (whichever starts
        #: first runs); handed on earlier, they would find the claim taken for a request
        #: that might never run (a revoked one) and be acknowledged as copies.
        self._unstarted: dict[str, Any] = {}
        self._parked: dict[str, list[Entry]] = {}
        self._after_release: list[Entry] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._thread = threading.Thread(target=self._run, name="celery-resilient-takes",
                                        daemon=True)
        self.batches = 0

    # -- the consumer's event loop ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        handed_results.accepting(self._defers)

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
        with self._lock:
            self._parked.clear()
            self._after_release.clear()
        # Finished requests (their acks waiting, or their results handed over) are not
        # Celery's any more, but their claims end with their results, not go back.
        finished = self._finished_requests()
        self._unflushed.clear()  # their delivery tags died with the connection
        self._flushed.clear()
        if known is not None:
            gone = [r for r in list(self._claims) if r.id not in known]
            for request in [r for r in gone if r in finished]:
                claim = self._claims.pop(request, None)
                # Celery dropped it before hearing that it started (its pool job was
                # flushed): it holds its key no more, or the copies the broker delivers
                # again would wait behind it for ever
                with self._lock:
                    if claim is not None and self._unstarted.get(claim[0]) is request:
                        del self._unstarted[claim[0]]
            self._give_back([r for r in gone if r not in finished])

    def finishing(self) -> frozenset[str]:
        """Work keys whose bodies ended here and whose ends are not settled yet: a result
        handed over and not committed, or an acknowledgement waiting for a flush. Their
        claims still read ``running`` and no request executes them, yet they must not be
        let go (the maintainer's reconcile asks this after reading what executes)."""
        keys = self._pending_results()
        for request in self._acks_waiting():
            claim = self._claims.get(request)
            if claim is not None:
                keys.add(claim[0])
        return frozenset(keys)

    def _finished_requests(self) -> set[Any]:
        """Requests whose acknowledgement waits here, or whose result this process holds."""
        pending = self._pending_results()
        finished = self._acks_waiting()
        finished.update(r for r, claim in list(self._claims.items()) if claim[0] in pending)
        return finished

    def _pending_results(self) -> set[str]:
        """Work keys of the results handed over and not committed yet."""
        with self._finish_lock:
            self._collect()
            return set(self._finishes)

    def _acks_waiting(self) -> set[Any]:
        return {entry[0] for entry in (*self._unflushed, *self._flushed)}

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
        if not self._defers or request not in self._claims:
            return False
        if self._stopping or self._hub is None:
            self._flush_inline()  # no thread to wait for: flush here, then acknowledge
            return False
        self._deferred += 1
        if not self._unflushed:
            self._unflushed_since = time.monotonic()
        self._unflushed.append((request, self._connection, self._deferred))
        # A finished request waiting for its flush holds a prefetch slot but no pool
        # process: the window widens by one until it is acknowledged, as Celery widens it
        # for a request waiting for its ETA, so the flush's latency does not starve the pool.
        self._widen(+1)
        self._wake.set()
        return True

    def _widen(self, by: int) -> None:
        """Widen (narrow) the consumer's prefetch window; Celery's event loop applies it."""
        qos = getattr(self._consumer, "qos", None)
        if qos is not None:
            (qos.increment_eventually if by > 0 else qos.decrement_eventually)(abs(by))

    def _flush_inline(self) -> None:
        try:
            if not self._commit_finishes():
                self.rt.store.flush()
        except Exception as exc:  # acknowledged anyway: the claim stays open in the store
            log.warning("could not flush before acknowledging (%s: %s)", type(exc).__name__,
                        exc)

    def _commit_finishes(self) -> bool:
        """Commit the results handed over so far in a statement of their own (no takes);
        whether it wrote (then it waited for the WAL flush). Raises if the store fails."""
        with self._finish_lock:
            self._collect()
            if not self._finishes:
                return False
            fins = list(self._finishes.values())
            _, finished = self.rt.store.take_batch([], [], self.owner, 0.0, 0, fins)
            self._committed_now(fins, finished)
            return bool(finished)

    def _collect(self) -> None:
        """The results pool processes handed over since the last call (lock held)."""
        for finish in self._reader.drain():
            if not self._finishes:
                self._finishes_since = time.monotonic()
            self._finishes[finish.work_key] = finish

    def _committed_now(self, fins: list[Finish], finished: set[str]) -> None:
        """``fins`` were in a statement that committed (lock held): they are done, or their
        claim moved on (taken over, stopped) and the result was not recorded."""
        for finish in fins:
            if self._finishes.get(finish.work_key) is finish:
                del self._finishes[finish.work_key]
            if finish.work_key not in finished:
                log.warning("result of work %s (epoch %d) not recorded: its claim moved on "
                            "before the group commit", finish.work_key, finish.epoch,
                            extra={"action": "finish_refused", "work_key": finish.work_key})
            elif killpoints.ARMED:
                self._committed.add(finish.work_key)

    def forget(self, request: Any) -> None:
        """``request`` was acknowledged or rejected: nothing more to mark for it. If its pool
        never started it (Celery discarded it: revoked, expired), its claim goes back first,
        then the requests waiting for its key are taken."""
        claim = self._claims.get(request)
        if claim is None:
            return
        with self._lock:
            never_started = self._unstarted.get(claim[0]) is request
        if never_started:
            self._give_back([request])
        else:
            self._claims.pop(request, None)

    def _unpark(self, key: str, holder: Any, to: deque[Entry]) -> None:
        """``holder`` no longer holds ``key`` unstarted: its waiters move ``to`` the ready
        queue (their own takes decide) or the waiting one (taken in the next batch)."""
        with self._lock:
            if self._unstarted.get(key) is not holder:
                return
            del self._unstarted[key]
            parked = self._parked.pop(key, [])
        for entry in parked:
            handed_claims.hand(entry[0].request_dict, self.owner.incarnation, None)
            to.append(entry)
        if parked:
            self._wake.set()
            with contextlib.suppress(BlockingIOError):
                os.write(self._write_fd, b"!")

    def _mark(self, mark: Started) -> None:
        with self._lock:
            first = not self._marks
            self._marks[(mark.work_key, mark.epoch)] = mark
            if first:
                self._marks_since = time.monotonic()
        if first:
            self._wake.set()  # the thread times the mark's wait from now

    def _give_back(self, requests: Collection[Any]) -> None:
        """Hand back the claims of requests that will not run here; requests waiting for
        their keys are taken once that is done."""
        claims = [c for c in (self._claims.pop(r, None) for r in requests) if c is not None]
        if claims:
            with self._lock:
                self._release.extend(claims)
                for key, _epoch in claims:
                    self._unstarted.pop(key, None)
                    self._after_release.extend(self._parked.pop(key, []))
            self._wake.set()

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
        while self._flushed:
            request, connection, _ = self._flushed.popleft()
            if connection == self._connection:
                if killpoints.ARMED:
                    self._before_ack(request)
                request.acknowledge_now()
                self._widen(-1)

    def _before_ack(self, request: Any) -> None:
        """Kill point ``before_ack`` of a result the main process committed (whole worker)."""
        claim = self._claims.get(request)
        if claim is not None and claim[0] in self._committed:
            self._committed.discard(claim[0])
            if killpoints.SCOPE != "process":
                killpoints.reached("before_ack")

    # -- the taking thread --------------------------------------------------------------

    def stop(self) -> None:
        """No more batched takes (warm shutdown): what was not handed on stays unacked and
        the broker restores it; its claims go back at the stop (``mark_stopped``). Results
        that come in from now on are flushed by the caller before their acknowledgement."""
        if self._stopping:
            return
        handed_results.accepting(False)  # results from now on: their pool processes finish them
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5)
        if self._defers:  # results handed over, and acknowledgements waiting for them
            self._flush_inline()
            self._flushed.extend(self._unflushed)
            self._unflushed.clear()
        # The event loop reads the pipe no more: what was flushed is acknowledged here
        # (Celery stops its steps on the loop's own thread), not left for the broker to
        # deliver again as a copy of finished work.
        try:
            self._ack_flushed()
        except Exception as exc:  # a connection already closed: the broker delivers them
            log.warning("could not acknowledge %d flushed result(s) at the stop (%s: %s)",
                        len(self._flushed) + 1, type(exc).__name__, exc)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _pause(self) -> float:
        """How long the thread may sleep: started marks wait for the next batch of takes,
        :data:`STARTED_DELAY` at most, acknowledgements :data:`FLUSH_DELAY`; after a failed
        flush, the next try waits a second."""
        if self._flush_failed_at is not None:
            return 1.0
        now = time.monotonic()
        pause = 1.0
        if self._marks:
            pause = min(pause, self._marks_since + STARTED_DELAY - now)
        if self._unflushed:
            pause = min(pause, self._unflushed_since + FLUSH_DELAY - now)
        if self._finishes:
            pause = min(pause, self._finishes_since + FLUSH_DELAY - now)
        return max(0.0, pause)

    def _flush_due(self) -> bool:
        """Whether waiting acknowledgements (or handed results) get a statement of their
        own now: no batch of takes covered them within :data:`FLUSH_DELAY`, or a second
        passed since a flush failed."""
        with self._finish_lock:
            self._collect()
        if not self._unflushed and not self._finishes:
            return False
        if self._flush_failed_at is not None:
            return time.monotonic() >= self._flush_failed_at + 1.0
        since = min(self._unflushed_since if self._unflushed else float("inf"),
                    self._finishes_since if self._finishes else float("inf"))
        return time.monotonic() >= since + FLUSH_DELAY

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(timeout=self._pause())
            self._wake.clear()
            if self._release:
                self._bounded(self._release_claims)
            while self._waiting and not self._stopping:
                self._gather()
                self._bounded(self._take_and_flush)
            if (self._marks and not self._stopping and self._flush_failed_at is None
                    and time.monotonic() >= self._marks_since + STARTED_DELAY):
                self._bounded(self._take_and_flush)
            if self._flush_due():  # no batch of takes covered them in time: a bare flush
                self._bounded(lambda: self._flush_acks(self._deferred, flushed=False))

    def _bounded(self, step: Callable[[], None]) -> None:
        """A silent store fails the step (a batch's pool processes take their own claims),
        it does not hang this thread."""
        with deadlines.bounded(self.rt.config.store_deadline):
            step()

    def _gather(self) -> None:
        """Let deliveries gather for one batch while the pool has work queued: as long as
        each pool process has a taken request waiting for it, up to :data:`GATHER_DELAY`."""
        deadline = time.monotonic() + GATHER_DELAY
        while (not self._stopping and len(self._waiting) < MAX_BATCH
               and self._pool_has_queued()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.wait(timeout=left)
            self._wake.clear()
        if self._release:  # its wake was taken here: the next round hands them back
            self._wake.set()

    def _pool_has_queued(self) -> bool:
        processes = getattr(getattr(self._consumer, "pool", None), "num_processes", None)
        if not isinstance(processes, int) or processes <= 0:
            return False
        with self._lock:
            return len(self._unstarted) >= processes

    def _take_and_flush(self) -> None:
        """A batch of takes; one that wrote waited for the WAL flush, so it covers every
        acknowledgement asked for before it began, handed on at once (a backlog keeps
        this thread taking: acks left for the end of the round waited seconds)."""
        upto = self._deferred
        if self._take_batch() and self._unflushed:
            self._flush_acks(upto, flushed=True)

    def _flush_acks(self, upto: int, flushed: bool) -> None:
        """Hand the waiting acknowledgements numbered up to ``upto`` to the event loop once
        a commit that waited for the WAL flush began after they were asked for
        (``flushed``: a batch of takes that wrote did; else a bare flush here)."""
        if not flushed:
            try:
                if not self._commit_finishes():
                    self.rt.store.flush()
            except Exception as exc:
                if self._flush_failed_at is None:
                    log.warning("could not flush %d result(s) before their acknowledgement "
                                "(%s: %s); retrying", len(self._unflushed),
                                type(exc).__name__, exc,
                                extra={"action": "flush_failed"})
                self._flush_failed_at = time.monotonic()
                return
        self._flush_failed_at = None
        moved = False
        while True:
            try:
                entry = self._unflushed.popleft()
            except IndexError:  # none left (or dropped meanwhile with a lost connection)
                break
            if entry[2] > upto:  # asked for after the commit began: it waits on
                self._unflushed.appendleft(entry)
                self._unflushed_since = time.monotonic()
                break
            self._flushed.append(entry)
            moved = True
        if not moved:
            return
        with contextlib.suppress(BlockingIOError):
            os.write(self._write_fd, b"!")

    def _release_claims(self) -> None:
        with self._lock:
            claims, self._release = self._release, []
            after, self._after_release = self._after_release, []
        try:
            # the broker delivers them again: the sweep waits before it re-publishes them
            self.rt.store.release_unstarted(self.owner, claims,
                                            self.rt.config.submit_timeout)
        except Exception as exc:  # the maintainer lets them go when they are not held
            log.warning("could not hand back %d claim(s) taken for dropped requests (%s: %s)",
                        len(claims), type(exc).__name__, exc)
        self._waiting.extend(after)

    def _take_batch(self) -> bool:
        """One statement of takes and marks; whether it took any claim (then it wrote, and
        its commit waited for the WAL flush)."""
        batch: list[Entry] = []
        while self._waiting and len(batch) < MAX_BATCH:
            batch.append(self._waiting.popleft())
        cfg = self.rt.config
        with self._finish_lock:
            self._collect()
            fins = list(self._finishes.values())
            with self._lock:
                # a claim's result supersedes its started or lost mark (one change per row)
                marks = [m for m in self._marks.values() if m.work_key not in self._finishes]
                self._marks = {}
            takes, keys, later = self._sort(batch)
            try:
                claims, finished = self.rt.store.take_batch(
                    takes, marks, self.owner, cfg.lease_seconds, cfg.max_attempts, fins)
            except Exception as exc:  # the results wait for the next statement
                log.warning("batched take of %d request(s) failed (%s: %s); their pool "
                            "processes take their own claims", len(takes), type(exc).__name__,
                            exc, extra={"action": "batch_take_failed"})
                claims, finished, fins = {}, set(), []
            self._committed_now(fins, finished)
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
            take = self._take_request(entry[0])
            if take is None:
                keys.append(None)
                continue
            key = take.work_key
            with self._lock:
                if key in self._unstarted:
                    self._parked.setdefault(key, []).append(entry)
                    keys.append("")
                    continue
            if key in taken or key in self._finishes:
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
                self._claims[request] = (claim.work_key, claim.epoch)
                with self._lock:
                    self._unstarted[key] = request
                    self._parked.setdefault(key, []).extend(later.pop(key, []))
            self._ready.append(entry)
        for waiters in later.values():
            for entry in waiters:
                handed_claims.hand(entry[0].request_dict, self.owner.incarnation, None)
                self._ready.append(entry)
        if batch:
            with contextlib.suppress(BlockingIOError):  # a wake is pending already
                os.write(self._write_fd, b"!")

    def _take_request(self, request: Any) -> TakeRequest | None:
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
