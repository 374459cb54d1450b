"""The procrastinate app peers.py runs (``python -m procrastinate --app
peers_procrastinate_app.app worker``).

Environment: PEERS_PG_DSN (the run's database; procrastinate's tables live in its ``public``
schema), PEERS_QUEUE, PEERS_EFFECT_LOG. Durability as procrastinate's docs set it up: jobs are
rows in PostgreSQL, deferred and finished in their own transactions; workers heartbeat every
10 s (default); and the "Retry stalled jobs" recipe, a periodic task that sends jobs of workers
whose heartbeat is older than 30 s (``get_stalled_jobs`` default) back to ``todo``, runs every
10 s here instead of the recipe's every 10 minutes so a SIGKILL is recovered within the run.
Bodies are ``async`` (procrastinate's native kind; a sync body would run in a thread).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg
from peers_units import LONG_POINT_S, PROGRESS_POINTS, SLEEP_S, UPSERT_PROGRESS, pg_dsn, task_name
from procrastinate import App, JobContext, PsycopgConnector

from celery_resilient.testing.effects import EffectLog

QUEUE = os.environ.get("PEERS_QUEUE", "peers")
RETRY_STALLED_CRON = "* * * * * */10"  # 6th field: seconds; the recipe: "*/10 * * * *"

app = App(connector=PsycopgConnector(conninfo=pg_dsn() if "PEERS_PG_DSN" in os.environ
                                     else ""))
effects = EffectLog(os.environ.get("PEERS_EFFECT_LOG", os.devnull))
_conn: psycopg.AsyncConnection[Any] | None = None


async def _upsert(unit: str, point: int) -> None:
    """No checkpoint API: a progress point is an autocommitted upsert of the benchmark's own,
    on one connection of this process's (psycopg serializes the two job slots on it)."""
    global _conn
    if _conn is None:
        _conn = await psycopg.AsyncConnection.connect(pg_dsn(), autocommit=True)
    await _conn.execute(UPSERT_PROGRESS, (unit, point))


@app.task(name=task_name("trivial"), queue=QUEUE)
async def trivial(unit: str) -> None:
    """Nothing but procrastinate's fetch and finish of the job row."""


@app.task(name=task_name("sleep"), queue=QUEUE)
async def sleep(unit: str) -> None:
    await asyncio.sleep(SLEEP_S)


@app.task(name=task_name("progress"), queue=QUEUE)
async def progress(unit: str) -> None:
    for point in range(1, PROGRESS_POINTS + 1):
        await _upsert(unit, point)


@app.task(name=task_name("long"), queue=QUEUE)
async def long_unit(unit: str, points: int) -> None:
    """The recovery case: a retried job runs again from its first point."""
    effects.record("start", at=time.time())
    for point in range(1, points + 1):
        effects.record(f"begin:{point}", at=time.time())
        await asyncio.sleep(LONG_POINT_S)
        await _upsert(unit, point)
    effects.record("end", at=time.time())


# The lock and periodic id carry the queue: one run uses several queues, and a retry job left
# ``todo`` in a queue nobody serves any more must not hold the lock of the live one.
@app.periodic(cron=RETRY_STALLED_CRON, periodic_id=QUEUE)
@app.task(name="peers.retry_stalled_jobs", queue=QUEUE,
          queueing_lock=f"retry_stalled_jobs-{QUEUE}", pass_context=True)
async def retry_stalled_jobs(context: JobContext, timestamp: int) -> None:
    """procrastinate's documented recovery of jobs left ``doing`` by a killed worker."""
    for job in await app.job_manager.get_stalled_jobs():
        await app.job_manager.retry_job(job)
