"""The DBOS app peers.py runs (``python peers_dbos_app.py``): launch, register the queue, wait.

Environment: PEERS_PG_DSN (the run's database; DBOS's system tables in its ``dbos`` schema),
PEERS_APP (DBOS application name), PEERS_QUEUE, PEERS_EXECUTOR_ID (one per process, as DBOS's
self-hosting docs require for ``worker_concurrency`` and for recovery: a restarted process
recovers the PENDING workflows of its own executor ID), PEERS_WORKER_CONCURRENCY,
PEERS_POLLING_S (the queue's polling interval; DBOS's default is 1 s), PEERS_EFFECT_LOG.
Durability is DBOS's default: every workflow's status and every step's output are rows in
the system database, written before the workflow or step is considered done.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from dbos import DBOS, DBOSConfig
from peers_units import LONG_POINT_S, PROGRESS_POINTS, SLEEP_S, pg_dsn, task_name

from celery_resilient.testing.effects import EffectLog

effects = EffectLog(os.environ.get("PEERS_EFFECT_LOG", os.devnull))


@DBOS.workflow(name=task_name("trivial"))
def trivial(unit: str) -> None:
    """Nothing but DBOS's dequeue and the workflow's status rows."""


@DBOS.workflow(name=task_name("sleep"))
def sleep(unit: str) -> None:
    time.sleep(SLEEP_S)


@DBOS.step(name="peers.point")
def point(unit: str, number: int) -> int:
    """A progress point: DBOS checkpoints a step's output when it returns."""
    return number


@DBOS.workflow(name=task_name("progress"))
def progress(unit: str) -> None:
    for number in range(1, PROGRESS_POINTS + 1):
        point(unit, number)


@DBOS.step(name="peers.long_point")
def long_point(number: int) -> int:
    effects.record(f"begin:{number}", at=time.time())
    time.sleep(LONG_POINT_S)
    return number


@DBOS.workflow(name=task_name("long"))
def long_unit(unit: str, points: int) -> None:
    """The recovery case: on replay, steps whose output is recorded do not run again."""
    effects.record("start", at=time.time())
    for number in range(1, points + 1):
        long_point(number)
    effects.record("end", at=time.time())


def main() -> int:
    queue = os.environ["PEERS_QUEUE"]
    config: DBOSConfig = {
        "name": os.environ["PEERS_APP"],
        "system_database_url": pg_dsn(),
        "executor_id": os.environ["PEERS_EXECUTOR_ID"],
        "application_version": "peers-bench",
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.listen_queues([queue])
    DBOS.launch()
    DBOS.register_queue(queue, worker_concurrency=int(os.environ["PEERS_WORKER_CONCURRENCY"]),
                        polling_interval_sec=float(os.environ["PEERS_POLLING_S"]),
                        on_conflict="always_update")
    print("PEERS-READY", flush=True)
    stop = threading.Event()

    def on_term(*_: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    stop.wait()
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
