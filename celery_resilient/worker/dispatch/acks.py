"""Acknowledgements that wait for a commit that flushed the WAL, and the flushes for them.

The pool process finishes a handed claim without waiting for the WAL flush (PostgreSQL), so
its acknowledgement waits here for a commit of the dispatcher's thread that does wait: the
next batch of takes that wrote, or, when none came within :data:`FLUSH_DELAY`, a bare flush.
One flush serves many results, each durable before its ack. Each waiting acknowledgement
carries its number, so a commit covers exactly those asked for before it began; the event
loop acknowledges them (the channel is not thread-safe). On SQLite the finish waits for its
own commit and no acknowledgement waits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from celery_resilient.runtime.runtime import Runtime
from celery_resilient.worker.dispatch.group_commit import GroupCommit
from celery_resilient.worker.dispatch.log import log

#: The longest an acknowledgement waits for a batch of takes to flush it before a bare flush
#: does: under a stream of work the next delivery comes within it (the window widens for
#: each waiting ack), and its batch's commit makes the result durable without a flush of
#: its own (one WAL flush instead of two).
FLUSH_DELAY = 0.005


class AckDeferral:
    """The acknowledgements waiting for a flush, those flushed, and when a flush is due."""

    def __init__(self, rt: Runtime, results: GroupCommit) -> None:
        self.rt = rt
        #: Whether acknowledgements wait here at all (PostgreSQL only: not on SQLite, nor
        #: on MySQL, whose every commit waits for its flush).
        self.defers = rt.store.dialect.group_commits
        #: A flush commits the results handed over, if any (that commit flushes them all).
        self._results = results
        #: Requests whose acknowledgement waits for a flush, and those flushed, with the
        #: consumer connection they came on and their number.
        self.unflushed: deque[tuple[Any, int, int]] = deque()
        self.flushed: deque[tuple[Any, int, int]] = deque()
        #: How many acknowledgements were ever deferred: each waiting one carries its
        #: number, so a commit covers exactly those asked for before it began.
        self.deferred = 0
        #: When the oldest acknowledgement not yet covered by a commit was asked for.
        self.unflushed_since = 0.0
        #: When the last bare flush failed (None: it did not); the next try waits a second.
        self.failed_at: float | None = None

    def defer(self, request: Any, connection: int) -> None:
        """``request``'s acknowledgement waits for the next commit that flushes."""
        self.deferred += 1
        if not self.unflushed:
            self.unflushed_since = time.monotonic()
        self.unflushed.append((request, connection, self.deferred))

    def waiting(self) -> set[Any]:
        """The requests whose acknowledgement waits here, flushed or not."""
        return {entry[0] for entry in (*self.unflushed, *self.flushed)}

    def drop(self) -> None:
        """The consumer's connection ended: their delivery tags died with it."""
        self.unflushed.clear()
        self.flushed.clear()

    def flush(self, upto: int, flushed: bool) -> bool:
        """Move the acknowledgements numbered up to ``upto`` to :attr:`flushed`: a commit
        that waited for the WAL flush began after they were asked for (a batch of takes
        that wrote, ``flushed``; else a bare flush made here first). Whether any moved."""
        if not flushed:
            try:
                self._flush()
            except Exception as exc:
                if self.failed_at is None:
                    log.warning("could not flush %d result(s) before their acknowledgement "
                                "(%s: %s); retrying", len(self.unflushed),
                                type(exc).__name__, exc,
                                extra={"action": "flush_failed"})
                self.failed_at = time.monotonic()
                return False
        self.failed_at = None
        moved = False
        while True:
            try:
                entry = self.unflushed.popleft()
            except IndexError:  # none left (or dropped meanwhile with a lost connection)
                break
            if entry[2] > upto:  # asked for after the commit began: it waits on
                self.unflushed.appendleft(entry)
                self.unflushed_since = time.monotonic()
                break
            self.flushed.append(entry)
            moved = True
        return moved

    def flush_inline(self) -> None:
        """A flush on the caller's thread, which then acknowledges (no thread waits)."""
        try:
            self._flush()
        except Exception as exc:  # acknowledged anyway: the claim stays open in the store
            log.warning("could not flush before acknowledging (%s: %s)", type(exc).__name__,
                        exc)

    def _flush(self) -> None:
        """A commit that waits for the WAL flush: of the results handed over, or a bare one
        when there are none. Raises if the store fails."""
        if not self._results.commit():
            self.rt.store.flush()

    def flush_at_stop(self) -> None:
        """The dispatcher stops: results handed over, and the acknowledgements waiting for
        them, are flushed here and now."""
        if self.defers:
            self.flush_inline()
            self.flushed.extend(self.unflushed)
            self.unflushed.clear()

    def flush_due(self) -> bool:
        """Whether waiting acknowledgements (or handed results) get a statement of their
        own now: no batch of takes covered them within :data:`FLUSH_DELAY`, or a second
        passed since a flush failed."""
        with self._results.lock:
            self._results.collect()
        if not self.unflushed and not self._results.finishes:
            return False
        if self.failed_at is not None:
            return time.monotonic() >= self.failed_at + 1.0
        since = min(self.unflushed_since if self.unflushed else float("inf"),
                    self._results.since if self._results.finishes else float("inf"))
        return time.monotonic() >= since + FLUSH_DELAY

    def flush_in(self, now: float) -> float:
        """How long (at most a second) until waiting acknowledgements or results are due a
        flush of their own: :data:`FLUSH_DELAY` after the oldest came in."""
        pause = 1.0
        if self.unflushed:
            pause = min(pause, self.unflushed_since + FLUSH_DELAY - now)
        if self._results.finishes:
            pause = min(pause, self._results.since + FLUSH_DELAY - now)
        return pause

    def take_flushed(self) -> Iterator[tuple[Any, int]]:
        """Each flushed request, taken off, with the connection it came on."""
        while self.flushed:
            request, connection, _ = self.flushed.popleft()
            yield request, connection
