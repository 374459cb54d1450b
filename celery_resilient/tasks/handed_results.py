"""Results a pool process hands to its worker's main process, which commits them in batches.

A pool process that ran a body under a claim handed by the batched takes (PostgreSQL) does
not write ``done`` itself: it writes the result to a pipe its worker's main process opened
before the pool forked, and the dispatcher commits the results of many tasks in its next
statement, before their acknowledgements (the *group commit*,
worker/dispatch/group_commit.py). One statement and one WAL flush serve many results, and
the pool process goes on to the next body without a round trip.

Only the plain case goes this way; everything else finishes in the pool process as before:

- a task whose result is stored (a result backend, ``ignore_result`` off): Celery stores
  SUCCESS right after the body, and a caller who reads it must find the work ``done`` in
  the store too, as before;
- a request with a canvas (links, errbacks, a chain, a chord, a group): what Celery does
  after the body relies on ``done`` being committed first (docs/guarantees.md, section 6);
- a claim handed in an earlier generation, or while this worker's lease is not surely its
  own (``tasks/handed_claims.py``): another worker may own it now, and the pool process's own
  finish is fenced by its epoch, so a zombie's result is refused before Celery hears of it;
- a result too big for one atomic write to a pipe (:data:`MAX_RECORD`), a full pipe, or a
  dispatcher that stopped taking them (a warm shutdown).

The relaxed ordering: Celery acknowledges nothing before the commit (the acknowledgement
waits for it in the main process), but a whole-worker SIGKILL between the hand-over and the
commit loses the result: the redelivered copy finds the claim open and runs the body again.
Store effects stay exactly once (steps, the ledger and checkpoints are fenced and committed
by the body itself); docs/architecture.md has the argument.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import time
from itertools import islice

from celery_resilient.store.batched_takes import Finish

#: The largest record one write hands over whole (POSIX: writes of at most ``PIPE_BUF``
#: bytes to a pipe are atomic, so records of several pool processes never interleave).
MAX_RECORD = select.PIPE_BUF

#: Shared with the pool processes (mapped at import, before the pool forks): byte 0 is 1
#: while the dispatcher takes results.
_shared = mmap.mmap(-1, 1)
_read_fd: int | None = None
_write_fd: int | None = None
#: This pool process's results handed over lately, by work key: until the main process
#: commits one, its claim still reads ``running`` under this process's PID, and a duplicate
#: delivery's take here must find it live, not dead (it would take it over and run the body
#: again). Kept :data:`REMEMBER_SECONDS`, far past any commit.
_handed: dict[str, float] = {}
REMEMBER_SECONDS = 120.0


def open_channel() -> None:
    """The worker's main process, before its pool forks: the pipe pool processes write to."""
    global _read_fd, _write_fd
    if _read_fd is not None:
        return
    _read_fd, _write_fd = os.pipe()
    os.set_blocking(_read_fd, False)
    os.set_blocking(_write_fd, False)  # a full pipe refuses: the pool process finishes itself


def accepting(on: bool) -> None:
    """The dispatcher starts (stops) committing handed results."""
    _shared[0] = 1 if on else 0


def hand(work_key: str, epoch: int, result_json: str | None) -> bool:
    """A pool process: hand the result over; False if it must finish the claim itself."""
    if _write_fd is None or not _shared[0]:
        return False
    record = (json.dumps([work_key, epoch, result_json], separators=(",", ":")) + "\n"
              ).encode()
    if len(record) > MAX_RECORD:
        return False
    try:
        if os.write(_write_fd, record) != len(record):
            return False
    except (BlockingIOError, OSError):
        return False
    now = time.monotonic()
    _handed.pop(work_key, None)  # to the end: the dict stays in the order handed
    _handed[work_key] = now
    for key, at in list(islice(_handed.items(), 2)):  # forget the oldest, a few per call
        if now - at <= REMEMBER_SECONDS:
            break
        del _handed[key]
    return True


def handed_here(work_key: str) -> bool:
    """Whether this process handed ``work_key``'s result over lately (its commit may be
    pending): its execution counts as live here."""
    at = _handed.get(work_key)
    return at is not None and time.monotonic() - at <= REMEMBER_SECONDS


class Reader:
    """The main process's end: the records written so far, whole."""

    def __init__(self) -> None:
        self._rest = b""

    def drain(self) -> list[Finish]:
        if _read_fd is None:
            return []
        chunks = [self._rest]
        while True:
            try:
                chunk = os.read(_read_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        data = b"".join(chunks)
        lines = data.split(b"\n")
        self._rest = lines.pop()  # a record is written whole: this is empty but for a read cut
        finishes = []
        for line in lines:
            key, epoch, result_json = json.loads(line)
            finishes.append(Finish(str(key), int(epoch), result_json))
        return finishes
