"""Hand-off on warm shutdown: running work moves to another worker at its next checkpoint.

A deploy sends SIGTERM (or ``celery control shutdown``); Celery then stops consuming and
waits for running tasks. Without a hand-off a long task either holds the deploy up or, if
the worker is killed at the grace period, starts again elsewhere from its last checkpoint
after its lease expires. With it, the main process raises one flag; each running
ResumableTask sees it at its next ``checkpoint.save`` (after that save committed), hands its
claim back with that checkpoint and re-publishes its message at once, so another worker
resumes it within a second or two and this one exits.

The flag is one byte of anonymous shared memory mapped when this module is imported (in the
worker's main process, before the prefork pool forks), so pool processes read it without a
store round trip or a signal of their own. Threads and solo pools share it trivially.
"""

from __future__ import annotations

import mmap

#: Shared across fork: MAP_SHARED | MAP_ANONYMOUS, one page.
_flag = mmap.mmap(-1, 1)


class HandOff(BaseException):
    """Raised by ``checkpoint.save`` while the worker shuts down warm (hand-off mode).

    A BaseException, like Celery's own SystemExit-based shutdown signals, so a task body's
    ``except Exception`` does not swallow it; ``ResumableTask`` turns it into a hand-back.
    """


def request() -> None:
    """Ask every running execution of this worker to hand its work off (signal-safe)."""
    _flag[0] = 1


def requested() -> bool:
    return _flag[0] == 1


def reset() -> None:
    _flag[0] = 0
