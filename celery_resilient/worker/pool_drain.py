"""Warm shutdown: the jobs the prefork pool already wrote to its processes stay its own.

At a warm shutdown Celery closes the pool, then the consumer's close flushes it
(``AsynPool.flush``). The flush drops from the pool's cache every job whose pool process had
not yet said it received it, "since they will be redelivered by the broker anyway". A job
already written to a process's pipe still runs there, though, and the pool's drain reads
the processes' results only while its cache holds a job. So when such a job is the last one:

- nobody reads its result, and its pool process waits 30 s (billiard's
  ``_ensure_messages_consumed``: 300 x 0.1 s) before it exits; the worker exits that much
  later;
- Celery never acknowledges its message, so the broker delivers it again, and it runs twice.

Plain Celery 5.7 with billiard 4.3 does this in about 2 of 8 warm shutdowns under a stream of
short tasks (docs/reliability.md). And a job whose message is larger than a pipe's buffer is
written in parts: the flush of a closing pool drops the rest, and its pool process waits for
it for ever (plain Celery: 5 of 6 such warm shutdowns never ended).

Here the pool's ``flush`` is wrapped, for a closing pool only (a warm shutdown; a lost
connection keeps Celery's behaviour): writes already begun are finished first, and jobs
written whole to a live pool process go back into the cache after the flush. The drain then
reads their results and Celery acknowledges them, as it does for every job that ran; the
consumer's stop counts them as known (:func:`pending_task_ids`), so their claims are not
handed back while they run.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from billiard.pool import RUN

log = logging.getLogger(__name__)

#: What the wrapper reads on billiard's pool and its jobs (private to Celery and billiard):
#: without them, the flush stays Celery's own.
_POOL_ATTRIBUTES = ("_cache", "_active_writers", "_state")


def keep_written_jobs(task_pool: Any) -> bool:
    """Wrap ``task_pool.flush`` (Celery's prefork ``TaskPool``, started); whether it did."""
    pool = getattr(task_pool, "_pool", None)
    flush: Callable[[], None] | None = getattr(task_pool, "flush", None)
    if pool is None or flush is None or not all(hasattr(pool, a) for a in _POOL_ATTRIBUTES):
        log.debug("pool flush left as it is: not Celery's asynchronous prefork pool")
        return False

    def flush_keeping_written() -> None:
        if pool._state == RUN:  # not closing: a lost connection, Celery's own behaviour
            flush()
            return
        finish_started_writes(pool)
        written = [job for job in list(pool._cache.values()) if written_to_live(pool, job)]
        flush()
        for job in written:
            pool._cache.setdefault(job._job, job)
        if written:
            log.info("warm shutdown: %d job(s) already written to pool processes are "
                     "drained with the rest", len(written), extra={"action": "drain_written"})

    task_pool.flush = flush_keeping_written
    return True


def finish_started_writes(pool: Any) -> None:
    """Write the rest of every job a pool process has begun to read. Celery's flush finishes
    such writes only while the pool runs; at a close it drops them, and the pool process
    waits for the rest of the message for ever (a payload larger than the pipe's buffer,
    64 KB on Linux, is written in parts), so the worker never exits."""
    flush_writer = getattr(pool, "_flush_writer", None)
    if flush_writer is None:
        return
    for job in list(pool._cache.values()):
        writer = _writer_of(job)
        process = getattr(job, "_write_to", None)
        if (writer is None or writer not in pool._active_writers or process is None
                or inspect.getgeneratorstate(writer) == inspect.GEN_CREATED):
            continue  # written whole, or not begun (the flush drops it: it never ran)
        if process._is_alive():
            flush_writer(process, writer)  # drops it from the active writers when done


def written_to_live(pool: Any, job: Any) -> bool:
    """Whether ``job`` was written whole to a pool process that is alive and has not said it
    received it yet (the jobs the flush would drop though they run)."""
    if getattr(job, "_accepted", True):
        return False
    process = getattr(job, "_write_to", None)
    if process is None or not process._is_alive():
        return False
    writer = _writer_of(job)
    return writer is None or writer not in pool._active_writers


def _writer_of(job: Any) -> Any:
    """The generator writing ``job`` to its pool process (a weak reference), if it lives."""
    writer_ref = getattr(job, "_writer", None)
    return writer_ref() if writer_ref is not None else None


def pending_task_ids(task_pool: Any) -> set[str]:
    """Task ids of the jobs the pool holds (queued, written to a process, or running): at a
    warm shutdown these include jobs Celery's own bookkeeping forgot at its consumer's close,
    and they will run and end here."""
    cache = getattr(getattr(task_pool, "_pool", None), "_cache", None)
    if not isinstance(cache, dict):
        return set()
    return {str(job.correlation_id) for job in list(cache.values())
            if getattr(job, "correlation_id", None)}
