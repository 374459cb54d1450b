"""Started and lost marks waiting for a statement to carry them.

The pool accepting a request marks its claim started (the pool process's PID becomes its
``owner_pid``); a pool process dying while it runs one clears the owner (the next take counts
the death). Marks ride with the next batch of takes, or get one of their own when none came
within :data:`STARTED_DELAY`. A mark whose row a transaction holds (a running body's
``ledger.atomic()``) is skipped by the batch and tried again later, so no batch waits on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container

from celery_resilient.store.batched_takes import Started

#: The longest a started mark waits for a batch of takes to travel with.
STARTED_DELAY = 0.05
#: How long a mark whose row a transaction held waits before a statement of its own tries
#: it again (it also rides with any batch of takes before then).
HELD_RETRY = 1.0


class StartMarks:
    """One mark per claim and statement: a death replaces a start not yet written."""

    def __init__(self, lock: threading.Lock) -> None:
        self._marks: dict[tuple[str, int], Started] = {}
        #: When the oldest mark waiting came in.
        self.since = 0.0
        #: Shared with the key parking (the event loop adds, the thread takes).
        self._lock = lock

    def add(self, mark: Started) -> bool:
        """Keep ``mark`` for the next statement; whether it is the first waiting (the
        thread times the marks' wait from now)."""
        with self._lock:
            first = not self._marks
            self._marks[(mark.work_key, mark.epoch)] = mark
            if first:
                self.since = time.monotonic()
        return first

    def defer(self, marks: list[Started]) -> None:
        """Keep ``marks``, which a batch skipped because a transaction held their rows, for
        a later statement: :data:`HELD_RETRY` from now unless other marks go sooner. A mark
        that came in since (a death after the start) is newer and kept instead."""
        if not marks:
            return
        with self._lock:
            first = not self._marks
            for mark in marks:
                self._marks.setdefault((mark.work_key, mark.epoch), mark)
            if first:
                self.since = time.monotonic() + HELD_RETRY - STARTED_DELAY

    def waiting(self) -> bool:
        return bool(self._marks)

    def take(self, superseded: Container[str]) -> list[Started]:
        """The marks for a statement, all taken: but those of claims whose result it
        commits (a claim's result supersedes its mark: one change per row)."""
        with self._lock:
            marks = [m for m in self._marks.values() if m.work_key not in superseded]
            self._marks = {}
        return marks
