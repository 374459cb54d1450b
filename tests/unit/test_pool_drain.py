"""The warm-shutdown flush keeps the jobs already written to a live pool process
(worker/pool_drain.py); tests/e2e/test_deploys.py proves what it mends on real workers."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from billiard.pool import CLOSE, RUN

from celery_resilient.worker import pool_drain


class Process:
    def __init__(self, alive: bool = True) -> None:
        self.alive = alive

    def _is_alive(self) -> bool:
        return self.alive


class Job:
    def __init__(self, job: int, accepted: bool = False, write_to: Process | None = None,
                 writer: Iterator[None] | None = None) -> None:
        self._job = job
        self._accepted = accepted
        self._write_to = write_to
        if writer is not None:
            self._writer = weakref.ref(writer)


class Pool:
    """billiard's pool as the flush sees it: Celery's flush drops every unaccepted job."""

    def __init__(self, state: int, jobs: list[Job], writers: set[Any]) -> None:
        self._state = state
        self._cache = {job._job: job for job in jobs}
        self._active_writers = writers


class TaskPool:
    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self.flushes = 0
        self.flush = self._flush

    def _flush(self) -> None:
        self.flushes += 1
        for job in list(self._pool._cache.values()):
            if not job._accepted:
                del self._pool._cache[job._job]


def _writing() -> Iterator[None]:
    yield


def _jobs() -> tuple[list[Job], set[Any], Iterator[None]]:
    live, dead = Process(), Process(alive=False)
    writing = _writing()
    jobs = [Job(1, accepted=True, write_to=live), Job(2, write_to=live),
            Job(3, write_to=dead), Job(4), Job(5, write_to=live, writer=writing)]
    return jobs, {writing}, writing


def test_a_closing_pool_keeps_jobs_written_whole_to_live_processes() -> None:
    jobs, writers, _writing_gen = _jobs()
    task_pool = TaskPool(Pool(CLOSE, jobs, writers))
    assert pool_drain.keep_written_jobs(task_pool)
    task_pool.flush()
    # accepted (kept by Celery), written whole to a live process (kept here); not those
    # written to a dead process, never written, or still being written
    assert sorted(task_pool._pool._cache) == [1, 2]
    assert task_pool.flushes == 1


def test_a_running_pool_flushes_as_celery_does() -> None:
    jobs, writers, _writing_gen = _jobs()
    task_pool = TaskPool(Pool(RUN, jobs, writers))
    assert pool_drain.keep_written_jobs(task_pool)
    task_pool.flush()
    assert sorted(task_pool._pool._cache) == [1]


def test_a_pool_without_a_flush_is_left_alone() -> None:
    class Solo:
        flush = None

    assert not pool_drain.keep_written_jobs(Solo())
    assert not pool_drain.keep_written_jobs(None)


def test_a_closing_pool_finishes_a_write_it_began_then_keeps_the_job() -> None:
    """A message larger than a pipe's buffer is written in parts: the rest is written before
    Celery's flush, which would drop it (its pool process would wait for it for ever)."""
    written: list[int] = []

    def write_in_parts() -> Iterator[None]:
        written.append(1)
        yield
        written.append(2)

    writer = write_in_parts()
    next(writer)  # the first part is in the pipe
    job = Job(7, write_to=Process(), writer=writer)
    job.correlation_id = "task-7"  # type: ignore[attr-defined]
    pool = Pool(CLOSE, [job], {writer})

    def flush_writer(process: Process, gen: Iterator[None]) -> None:
        for _ in gen:
            pass
        pool._active_writers.discard(gen)

    pool._flush_writer = flush_writer  # type: ignore[attr-defined]
    task_pool = TaskPool(pool)
    assert pool_drain.keep_written_jobs(task_pool)
    task_pool.flush()
    assert written == [1, 2] and sorted(pool._cache) == [7]
    assert pool_drain.pending_task_ids(task_pool) == {"task-7"}
