"""The Celery app the throughput benchmark runs in real ``celery worker`` processes.

Configured by environment: ``BENCH_BROKER``, ``BENCH_QUEUE``, ``BENCH_BACKEND`` (results
stored there when set), ``BENCH_RESILIENT`` ("1": wire
``Resilient(app)`` with ``BENCH_STORE_URL``/``BENCH_TABLE_PREFIX``, and with
``BENCH_RELIABLE_FETCH`` "0" kombu's own Redis fetch; "0": plain Celery, no celery-resilient
at all), ``BENCH_CHECKPOINTS`` (progress points per task: a ResumableTask saves a checkpoint
at each, plain Celery makes the hand-written equivalent, an autocommitted upsert of a progress
row in ``BENCH_PROGRESS_TABLE`` through psycopg at ``BENCH_PROGRESS_DSN``, one connection per
process with psycopg's defaults), and optional ``BENCH_PROFILE_DIR``: time every store call
and every SQL statement per process and write them there as JSON when the process exits
(measurement only; the library is not changed, its ``Store`` methods are wrapped from here).
"""

from __future__ import annotations

import cProfile
import functools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery, signals
from sqlalchemy import Engine, event

from celery_resilient import Resilient, ResumableTask
from celery_resilient.store.hot import HotStatements
from celery_resilient.store.sql import Store

app = Celery("bench", broker=os.environ.get("BENCH_BROKER", "redis://127.0.0.1:6379/13"))
app.conf.update(
    task_default_queue=os.environ.get("BENCH_QUEUE", "bench"),
    # BENCH_BACKEND: a result backend URL; every task stores its result and the caller reads it
    task_ignore_result=not os.environ.get("BENCH_BACKEND"),
    result_backend=os.environ.get("BENCH_BACKEND") or None,
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
)
if os.environ.get("BENCH_RESILIENT", "0") == "1":
    app.conf.resilient_store_url = os.environ["BENCH_STORE_URL"]
    app.conf.resilient_table_prefix = os.environ.get("BENCH_TABLE_PREFIX", "resilient_")
    app.conf.resilient_reliable_fetch = os.environ.get("BENCH_RELIABLE_FETCH", "1") == "1"
    # BENCH_BATCHED_TAKES=0: each pool process takes its own claims (compare the two)
    app.conf.resilient_batched_takes = os.environ.get("BENCH_BATCHED_TAKES", "1") == "1"
    Resilient(app)


_BODY_S = float(os.environ.get("BENCH_BODY_MS", "0")) / 1000
_CHECKPOINTS = int(os.environ.get("BENCH_CHECKPOINTS", "0"))
_progress: tuple[int, Any] | None = None


def _upsert_progress(n: int, point: int) -> None:
    """Plain Celery's progress point, as a user would write it without this library."""
    global _progress
    import psycopg

    if _progress is None or _progress[0] != os.getpid():  # opened after the fork
        _progress = (os.getpid(), psycopg.connect(os.environ["BENCH_PROGRESS_DSN"],
                                                  autocommit=True))
    _progress[1].execute(
        f"INSERT INTO {os.environ['BENCH_PROGRESS_TABLE']} (task, state) VALUES (%s, %s) "
        "ON CONFLICT (task) DO UPDATE SET state = excluded.state",
        (str(n), json.dumps({"point": point})))


@app.task(name="bench.plain", acks_late=True)
def plain(n: int) -> int:
    """The baseline: a task with ``acks_late=True`` (trivial unless BENCH_BODY_MS is set)."""
    for point in range(1, _CHECKPOINTS + 1):
        _upsert_progress(n, point)
    if _BODY_S:
        time.sleep(_BODY_S)
    return n


@app.task(name="bench.resumable", base=ResumableTask, bind=True)
def resumable(self: ResumableTask, n: int) -> int:
    """The same body as a ResumableTask (claim, finish, receipt, all in the store)."""
    for point in range(1, _CHECKPOINTS + 1):
        self.checkpoint.save({"point": point})
    if _BODY_S:
        time.sleep(_BODY_S)
    return n


# -- optional profiling: store calls and SQL statements, per process ----------------------------

_PROFILE_DIR = os.environ.get("BENCH_PROFILE_DIR")
_calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
_sql: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = _calls[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    return wrapper


def _install_profiling() -> None:
    for name in ("record_receipt", "take", "finish", "heartbeat", "claim_orphans",
                 "load_checkpoint", "save_checkpoint", "get_step", "put_step"):
        setattr(Store, name, _timed(f"Store.{name}", getattr(Store, name)))
    run_hot = HotStatements.run

    def timed_hot(self: HotStatements, conn: Any, name: str, params: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return run_hot(self, conn, name, params)
        finally:  # hot statements bypass SQLAlchemy's cursor events on PostgreSQL
            entry = _sql[f"(hot statement) {name}"]
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    HotStatements.run = timed_hot  # type: ignore[method-assign]

    @event.listens_for(Engine, "before_cursor_execute")
    def _before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        conn.info["bench_t0"] = time.perf_counter()

    @event.listens_for(Engine, "after_cursor_execute")
    def _after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        t0 = conn.info.pop("bench_t0", None)
        if t0 is not None:
            entry = _sql[" ".join(statement.split())[:90]]
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    @event.listens_for(Engine, "commit")
    def _commit(conn: Any) -> None:
        _sql["(commit)"][0] += 1


def _dump(role: str) -> None:
    assert _PROFILE_DIR is not None
    path = Path(_PROFILE_DIR) / f"{role}-{os.getpid()}.json"
    path.write_text(json.dumps({"role": role, "calls": dict(_calls), "sql": dict(_sql)}))


_profiler: cProfile.Profile | None = None


def _start_cprofile() -> None:
    """With BENCH_CPROFILE=1: a CPU-time profile of this process (every thread's CPU, not
    wall time), written beside the store timings as ``<role>-<pid>.prof``."""
    global _profiler
    if os.environ.get("BENCH_CPROFILE") == "1":
        _profiler = cProfile.Profile(time.process_time)
        _profiler.enable()


def _stop_cprofile(role: str) -> None:
    if _profiler is not None and _PROFILE_DIR is not None:
        _profiler.disable()
        _profiler.dump_stats(str(Path(_PROFILE_DIR) / f"{role}-{os.getpid()}.prof"))


if _PROFILE_DIR:
    _install_profiling()

    @signals.worker_init.connect(weak=False)
    def _profile_main(**_: Any) -> None:
        _start_cprofile()

    @signals.worker_process_init.connect(weak=False)
    def _profile_child(**_: Any) -> None:
        _start_cprofile()

    @signals.worker_process_shutdown.connect(weak=False)
    def _dump_child(**_: Any) -> None:
        _stop_cprofile("child")
        _dump("child")

    @signals.worker_shutdown.connect(weak=False)
    def _dump_main(**_: Any) -> None:
        _stop_cprofile("main")
        _dump("main")
