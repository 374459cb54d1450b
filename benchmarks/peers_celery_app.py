"""The Celery app peers.py runs in ``celery worker -c 2``: plain Celery or ResumableTask.

Environment: PEERS_MODE (``plain``: no celery-resilient at all, ``acks_late=True`` tasks as
``throughput.py``'s baseline; ``resumable``: ``Resilient(app)`` with every setting at its
default and the store in the run's PostgreSQL database), PEERS_BROKER, PEERS_QUEUE,
PEERS_STORE_URL, PEERS_TABLE_PREFIX, PEERS_PG_DSN (plain's progress upserts) and
PEERS_EFFECT_LOG (the recovery case's witness).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
from celery import Celery
from peers_units import (
    LONG_POINT_S,
    PROGRESS_POINTS,
    SLEEP_S,
    UPSERT_PROGRESS,
    pg_dsn,
    task_name,
)

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing.effects import EffectLog

MODE = os.environ.get("PEERS_MODE", "plain")
app = Celery("peers", broker=os.environ.get("PEERS_BROKER", "redis://127.0.0.1:6379/10"))
app.conf.update(
    task_default_queue=os.environ.get("PEERS_QUEUE", "peers"),
    task_ignore_result=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
)
effects = EffectLog(os.environ.get("PEERS_EFFECT_LOG", os.devnull))

_conn: tuple[int, psycopg.Connection[Any]] | None = None


def _upsert(unit: str, point: int) -> None:
    """Plain Celery's progress point: one autocommitted upsert on a per-process connection."""
    global _conn
    if _conn is None or _conn[0] != os.getpid():  # opened in the pool child, after the fork
        _conn = (os.getpid(), psycopg.connect(pg_dsn(), autocommit=True))
    _conn[1].execute(UPSERT_PROGRESS, (unit, point))


if MODE == "resumable":
    app.conf.resilient_store_url = os.environ["PEERS_STORE_URL"]
    app.conf.resilient_table_prefix = os.environ["PEERS_TABLE_PREFIX"]
    Resilient(app)

    @app.task(name=task_name("trivial"), base=ResumableTask, bind=True)
    def trivial(self: ResumableTask, unit: str) -> None:
        """Nothing but the claim, the result and the receipt the store records."""

    @app.task(name=task_name("sleep"), base=ResumableTask, bind=True)
    def sleep(self: ResumableTask, unit: str) -> None:
        time.sleep(SLEEP_S)

    @app.task(name=task_name("progress"), base=ResumableTask, bind=True)
    def progress(self: ResumableTask, unit: str) -> None:
        """Five durable checkpoints, the library's progress points."""
        for point in range(1, PROGRESS_POINTS + 1):
            self.checkpoint.save({"point": point})

    @app.task(name=task_name("long"), base=ResumableTask, bind=True)
    def long_unit(self: ResumableTask, unit: str, points: int) -> None:
        """The recovery case: resumes after the last checkpoint it finds."""
        done = int(self.checkpoint.load(default={"point": 0})["point"])
        effects.record("start", at=time.time())
        for point in range(done + 1, points + 1):
            effects.record(f"begin:{point}", at=time.time())
            time.sleep(LONG_POINT_S)
            self.checkpoint.save({"point": point})
        effects.record("end", at=time.time())

else:

    @app.task(name=task_name("trivial"), acks_late=True)
    def trivial(unit: str) -> None:
        """The baseline: ``acks_late=True``, nothing durable but the broker's message."""

    @app.task(name=task_name("sleep"), acks_late=True)
    def sleep(unit: str) -> None:
        time.sleep(SLEEP_S)

    @app.task(name=task_name("progress"), acks_late=True)
    def progress(unit: str) -> None:
        """No checkpoint API: each progress point is an upsert of the benchmark's own."""
        for point in range(1, PROGRESS_POINTS + 1):
            _upsert(unit, point)

    @app.task(name=task_name("long"), acks_late=True, reject_on_worker_lost=True)
    def long_unit(unit: str, points: int) -> None:
        """The recovery case: records progress, but a rerun starts from the first point."""
        effects.record("start", at=time.time())
        for point in range(1, points + 1):
            effects.record(f"begin:{point}", at=time.time())
            time.sleep(LONG_POINT_S)
            _upsert(unit, point)
        effects.record("end", at=time.time())
