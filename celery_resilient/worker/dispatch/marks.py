"""Started and lost marks waiting for a statement to carry them.

The pool accepting a request marks its claim started (the pool process's PID becomes its
``owner_pid``); a pool process dying while it runs one clears the owner (the next take counts
the death). Marks ride with the next batch of takes, or get one of their own when none came
within :data:`STARTED_DELAY`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Container

from celery_resilient.store.batched_takes import Started

#: The longest a started mark waits for a batch of takes to travel with.
STARTED_DELAY = 0.05


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

    def waiting(self) -> bool:
        return bool(self._marks)

    def take(self, superseded: Container[str]) -> list[Started]:
        """The marks for a statement, all taken: but those of claims whose result it
        commits (a claim's result supersedes its mark: one change per row)."""
        with self._lock:
            marks = [m for m in self._marks.values() if m.work_key not in superseded]
            self._marks = {}
        return marks
