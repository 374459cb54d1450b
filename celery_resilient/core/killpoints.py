"""Kill points: SIGKILL a worker at a chosen point of a task, to test what survives it.

Set ``RESILIENT_KILL_AT`` in the worker's environment::

    RESILIENT_KILL_AT=after_checkpoint:3     # the 3rd checkpoint save in a process
    RESILIENT_KILL_AT=after_effect            # the 1st step/ledger effect, before its marker
    RESILIENT_KILL_AT=before_ack,after_step:2 # several points (the first one reached fires)

Points, in the order a task reaches them:

``after_checkpoint``
    ``self.checkpoint.save()`` committed, control not yet back in the task body.
``after_effect``
    the function of ``self.step()`` or ``self.ledger.once()`` returned, its marker not yet
    written: the replay runs the effect again (the at-least-once window of effects outside
    the store).
``after_step``
    a step's result (or a ``ledger.once`` marker) committed.
``before_ack``
    the result and ``done`` state committed, the broker message not yet acknowledged: the
    redelivered copy must return the stored result and run nothing. A result handed to the
    main process (``tasks/handed_results.py``) is committed there: a whole-worker kill fires in the
    main process after that commit, a pool-process kill in the pool process once it handed
    the result over (the main process commits it).
``after_finish_handed``
    a pool process handed its result to the main process (``tasks/handed_results.py``), which has
    not committed it: a whole-worker kill loses it, and the copy runs the body again (store
    effects once).
``after_failed``
    the body raised and ``failed`` is committed, Celery not yet told (no FAILURE stored, no
    errback run, no chord part counted): the redelivered copy must replay the failure.
``before_success_stored``
    Celery sent a success's ``link`` callbacks and has not stored SUCCESS yet, reached only
    in a result backend that calls :func:`reached` there (the canvas tests'): the copy
    that returns the stored result makes Celery send the callbacks again, under the ids
    they had (a resumable callback runs once).
``before_chord_count``
    Celery stored a chord header's SUCCESS or FAILURE and has not counted the part yet
    (``on_chord_part_return``): Celery's own window, reached only in a result backend that
    calls :func:`reached` there (the canvas tests' Redis backend); the redelivered copy
    must count the part, once.
``before_chord_body_sent``
    Celery 5.7's Redis backend claimed the right to send a chord's body and has not sent
    it (reached only in the canvas tests' backend): the copy of the header that was
    dispatching waits for the claim to expire and counts again, which sends the body.
``after_batch_take``
    the worker's main process committed a batch of takes (worker/dispatch/taker.py) and has
    not handed those requests to the pool: each claim is ``running`` and was never seen to
    start; the copies the restarted worker gets must each run once, with no death counted.
``mid_prune``
    inside a retention batch's transaction: finished work rows deleted, their steps not yet
    (the batch must be rolled back whole).

``<nth>`` (default 1) counts the times the point is reached in one process. By default the
whole process group is killed (the worker's main process and its pool, as ``kill -9`` of a
worker started in its own group, e.g. by ``resilient_nodes``); ``RESILIENT_KILL_SCOPE=process``
kills only the process that reached the point (a prefork pool child: the main process survives
and sees ``WorkerLostError``). A restarted worker inherits the same environment and would
kill itself again; set ``RESILIENT_KILL_ONCE=<path>`` to fire once across restarts (the file
is created just before the kill, and an existing file disarms every kill point).

Production cost: the environment is read once at import; when ``RESILIENT_KILL_AT`` is unset,
each point costs one module attribute test (``if killpoints.ARMED``).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

ENV = "RESILIENT_KILL_AT"
ONCE_ENV = "RESILIENT_KILL_ONCE"
SCOPE_ENV = "RESILIENT_KILL_SCOPE"
POINTS = ("before_ack", "after_failed", "after_checkpoint", "after_step", "after_effect",
          "before_chord_count", "before_success_stored", "before_chord_body_sent",
          "after_batch_take", "after_finish_handed", "mid_prune")


def parse(spec: str | None) -> dict[str, int]:
    """``"after_checkpoint:3,before_ack"`` -> ``{"after_checkpoint": 3, "before_ack": 1}``."""
    armed: dict[str, int] = {}
    for raw in (spec or "").split(","):
        part = raw.strip()
        if not part:
            continue
        point, _, nth = part.partition(":")
        if point not in POINTS:
            raise ValueError(f"{ENV}: unknown kill point {point!r}; known: {', '.join(POINTS)}")
        try:
            count = int(nth) if nth else 1
        except ValueError:
            raise ValueError(f"{ENV}: {part!r} needs a positive count after ':'") from None
        if count < 1:
            raise ValueError(f"{ENV}: {part!r} needs a positive count after ':'")
        armed[point] = count
    return armed


_armed: dict[str, int] = parse(os.environ.get(ENV))
#: ``group`` (the whole worker) or ``process`` (the one that reached the point).
SCOPE = os.environ.get(SCOPE_ENV, "group")
#: False in production: the library tests this before calling :func:`reached`.
ARMED: bool = bool(_armed)
_hits: Counter[str] = Counter()
_lock = threading.Lock()


def reached(point: str) -> None:
    """Called by the library at ``point``; SIGKILLs when this is the armed occurrence."""
    if point not in _armed:
        return
    with _lock:
        _hits[point] += 1
        if _hits[point] != _armed[point]:
            return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:  # O_EXCL: of two processes reaching a point at once, only one fires
            fd = os.open(once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        os.write(fd, f"{point}:{_armed[point]} pid={os.getpid()}\n".encode())
        os.fsync(fd)
        os.close(fd)
    if SCOPE == "process":
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def arm(spec: str | None) -> None:
    """Re-read a kill spec in this process (tests of the kill points themselves)."""
    global ARMED, SCOPE, _armed
    _armed = parse(spec)
    SCOPE = os.environ.get(SCOPE_ENV, "group")
    _hits.clear()
    ARMED = bool(_armed)


__all__ = ["ENV", "ONCE_ENV", "POINTS", "SCOPE", "SCOPE_ENV", "arm", "reached"]
