"""What one unit of each peers.py workload does, shared by the four systems' app modules.

Every system runs the same bodies so that only the machinery around them differs: a trivial
body, a 10 ms sleep, five durable progress points, and the long unit of the SIGKILL-recovery
case. Systems without a checkpoint API (plain Celery, procrastinate) make each progress point
an autocommitted upsert into ``PROGRESS_TABLE``, a table of the benchmark's own.
"""

from __future__ import annotations

import os

SLEEP_S = 0.010
PROGRESS_POINTS = 5
#: the recovery case: LONG_POINTS points of LONG_POINT_S seconds each, killed during KILL_AT
LONG_POINTS = 8
LONG_POINT_S = 0.5
KILL_AT = 5

WORKLOADS = ("trivial", "sleep", "progress")
PROGRESS_TABLE = "peers_progress"
CREATE_PROGRESS = (f"CREATE TABLE IF NOT EXISTS {PROGRESS_TABLE} "
                   "(unit text PRIMARY KEY, point integer NOT NULL)")
UPSERT_PROGRESS = (f"INSERT INTO {PROGRESS_TABLE} (unit, point) VALUES (%s, %s) "
                   "ON CONFLICT (unit) DO UPDATE SET point = EXCLUDED.point")


def task_name(workload: str) -> str:
    """The name every system registers a workload's unit under."""
    return f"peers.{workload}"


def pg_dsn() -> str:
    """libpq URL of the run's database (PEERS_PG_DSN), tagged with this process's role."""
    dsn = os.environ["PEERS_PG_DSN"]
    role = os.environ.get("PEERS_APP_NAME", "peers-worker")
    return f"{dsn}{'&' if '?' in dsn else '?'}application_name={role}"
