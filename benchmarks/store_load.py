"""Many workers on one store: the store's hot path from 1 to 64 concurrent processes.

What: each simulated pool process is a real OS process (``multiprocessing``, fork) with its own
``Store`` and engine, against one database under a throwaway table prefix (dropped afterwards).
``--stores postgresql,mysql`` runs the same levels against each store in turn, in the order given
(MySQL/MariaDB at ``--mysql-url``), each under a prefix of its own, so the two stores are compared
on the same machine in the same run; the default is ``postgresql`` alone. It calls only the
``Store`` methods a worker calls, in the worker's order:

- at start: ``register`` (one incarnation per simulated worker, as ``ResilientWorkerStep.start``);
- per unit of work: the receipt (``record_receipts``, one multi-row statement per batch of
  ``--prefetch`` deliveries, as the maintainer flushes them), ``take`` (the claim; the receipt
  makes it the one-statement fast path), three ``Checkpoint.save`` calls (the fenced upsert a
  task's ``self.checkpoint.save`` runs) and ``finish``;
- every ``--heartbeat-every`` s: ``heartbeat`` (the incarnation's lease renewal, ``LeaseKeeper``);
- every ``--sweep-every`` s: the maintainer's round, ``reconcile`` + ``up_for`` +
  ``claim_orphans`` (reported together as "sweep", and each on its own).

With ``--procs-per-worker K`` (default 1) K processes share one incarnation and only the first
one heartbeats and sweeps (a ``celery worker -c K``); then ``reconcile`` gets no held/executing
sets, so it judges only pool-process liveness.

Heartbeats and sweeps run between units in the same process (the worker runs them on threads);
the first one at a random offset within its interval. The defaults (1 s, 2 s) are 5x and 2.5x
the library's (``resilient_heartbeat_interval`` and ``resilient_sweep_interval`` = 5 s), so the
maintainer's share here is an upper bound and there are enough samples for a p99.

Per level it reports units/s (finished units over the window) and p50/p99 per operation, and
PostgreSQL's view of the same window: transactions committed/s and WAL flushes/s
(``pg_stat_database``, ``pg_stat_wal``: database-wide, so other clients of the database count
too), the mean number of this run's backends that were active, idle in a transaction or idle
(``pg_stat_activity`` sampled every 0.1 s, by ``application_name``) and what the active ones
waited on, and the machine's CPU use (``/proc/stat``) with the simulated workers' share.
For MySQL/MariaDB the same window is read from ``SHOW GLOBAL STATUS`` deltas, server-wide (every
client of the server counts, whatever its database): commits/s (``Handler_commit``: it counts each
statement's commit as well as each transaction's, so an explicit transaction of n statements counts
n + 1 and an autocommitted statement 1, read-only ones too; ``Com_commit`` counts the explicit
``COMMIT`` statements, not the autocommitted ones), redo log flushes/s (``Innodb_os_log_fsyncs``;
MariaDB 10.8 dropped it, so there ``Innodb_log_writes``: at ``innodb_flush_log_at_trx_commit=1``
each group commit's write is followed by one flush), every InnoDB fsync/s (``Innodb_data_fsyncs``,
data files too), rollbacks (``Handler_rollback``), ``Innodb_row_lock_waits`` with their total wait,
``Innodb_deadlocks``, and ``Threads_running`` sampled every 0.1 s (less the sampler's own), the
nearest thing to PostgreSQL's active backends.

Before the load levels (PostgreSQL only), a session-state check (``--no-session-check`` skips it)
tells whether the hot path could run behind a transaction-mode pooler (PgBouncer
``pool_mode=transaction``, none is installed here): it records every SQL statement of a unit, a
heartbeat and a sweep (SQLAlchemy ``before_cursor_execute``) and looks for session state (``SET``
without ``LOCAL``, advisory locks, ``LISTEN``, ``PREPARE``, temporary tables, ``WITH HOLD``
cursors), lists the server-side prepared statements the driver left on the connection
(``pg_prepared_statements``; psycopg 3 prepares a statement after its 5th execution), and runs the
hot path for a few seconds on one process three ways: the Store's own pooled engine, a fresh
connection per transaction (``NullPool``: nothing survives between transactions), and a pooled
engine with psycopg's automatic prepared statements off (``prepare_threshold=None``). The engine
swap is the only thing this script does behind the ``Store``'s back (the Store builds its engine
privately).

    PYTHONPATH=. python benchmarks/store_load.py [--levels 1,4,16,64] [--seconds 10]
    PYTHONPATH=. python benchmarks/store_load.py --quick      # 1,4,16 for 4 s each, < 60 s
    PYTHONPATH=. python benchmarks/store_load.py --quick --stores postgresql,mysql

Prints markdown tables (stdout); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import random
import re
import resource
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import psycopg
import sqlalchemy
from bench_common import machine, markdown_table, percentile
from sqlalchemy import create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

import celery_resilient
from celery_resilient.core import codec
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.sql import Ended, Receipt, Store
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.execution import Execution
from celery_resilient.testing.services import drop_prefixed_tables

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/test"
STORES = ("postgresql", "mysql")
TASK = "bench.store_load"
PROBE = "store_load_probe"  # marks this script's own catalog queries
CONFIG = ResilientConfig()
OPS = ("receipts", "take", "save", "finish", "unit", "heartbeat", "reconcile", "up_for",
       "claim_orphans", "sweep")
# A broker message of realistic size: the receipt stores it so the sweep can re-publish it.
MESSAGE = json.dumps({"body": "W1tdLHt9LHsiY2FsbGJhY2tzIjpudWxsfV0=" * 8,
                      "headers": {"lang": "py", "task": TASK, "retries": 0, "argsrepr": "()",
                                  "kwargsrepr": "{}", "origin": "gen1@bench"},
                      "properties": {"delivery_mode": 2, "priority": 0},
                      "content-type": "application/json", "content-encoding": "utf-8"})
SESSION_STATE = {
    "SET without LOCAL": re.compile(r"^\s*SET\s+(?!LOCAL\b)(SESSION\s+)?\w", re.I | re.M),
    "advisory lock": re.compile(r"pg_(try_)?advisory", re.I),
    "LISTEN/NOTIFY": re.compile(r"\b(LISTEN|UNLISTEN)\b", re.I),
    "PREPARE": re.compile(r"^\s*(PREPARE|DEALLOCATE)\b", re.I | re.M),
    "temporary table": re.compile(r"\bTEMP(ORARY)?\s+TABLE\b", re.I),
    "WITH HOLD cursor": re.compile(r"\bWITH\s+HOLD\b", re.I),
    "session-level setting function": re.compile(r"set_config\s*\(.*(false|0)\s*\)", re.I),
}


def tagged(url: str, tag: str) -> str:
    """The URL with ``application_name`` set, so pg_stat_activity shows this run's backends."""
    return make_url(url).update_query_dict({"application_name": tag}).render_as_string(False)


class _FixedEngine:
    """Stands in for the Store's private engine holder (session-state check only)."""

    def __init__(self, engine: sqlalchemy.Engine) -> None:
        self.engine = engine

    def get(self) -> sqlalchemy.Engine:
        return self.engine

    def dispose(self) -> None:
        self.engine.dispose()


class SimWorker:
    """One simulated pool process: receipts, take, three saves, finish; heartbeat and sweep."""

    def __init__(self, store: Store, owner: Owner, name: str, prefetch: int, maintainer: bool,
                 solo: bool, heartbeat_every: float, sweep_every: float) -> None:
        self.store, self.owner, self.name = store, owner, name
        self.prefetch, self.maintainer, self.solo = prefetch, maintainer, solo
        self.heartbeat_every, self.sweep_every = heartbeat_every, sweep_every
        self.pending: list[str] = []
        self.n = 0
        self.times: dict[str, list[float]] = defaultdict(list)
        self.orphans = 0
        now = time.monotonic()
        self.next_heartbeat = now + random.uniform(0, heartbeat_every)
        self.next_sweep = now + random.uniform(0, sweep_every)

    def timed(self, op: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter_ns()
        value = fn()
        self.times[op].append((time.perf_counter_ns() - t0) / 1e6)
        return value

    def unit(self) -> None:
        if not self.pending:
            keys = [f"{self.name}-{self.n + i}" for i in range(self.prefetch)]
            self.n += self.prefetch
            receipts = [Receipt(k, TASK, k, None, MESSAGE) for k in keys]
            self.timed("receipts", lambda: self.store.record_receipts(
                receipts, self.owner, CONFIG.lease_seconds))
            self.pending = keys[::-1]
        key = self.pending.pop()
        t0 = time.perf_counter_ns()
        outcome = self.timed("take", lambda: self.store.take(
            key, TASK, key, None, self.owner, CONFIG.lease_seconds, CONFIG.max_attempts,
            is_live=lambda *_: False))
        claim = outcome.claim
        assert claim is not None, outcome
        checkpoint = Checkpoint(Execution(self.store, CONFIG, key, claim.epoch, claim.attempts))
        for i in range(3):
            self.timed("save", lambda i=i: checkpoint.save({"row": i * 1000, "file": key}))
        result = codec.encode({"rows": 3000}, "result")
        self.timed("finish", lambda: self.store.finish(key, claim.epoch, result))
        self.times["unit"].append((time.perf_counter_ns() - t0) / 1e6)

    def maintain(self, now: float) -> None:
        if not self.maintainer:
            return
        if now >= self.next_heartbeat:
            self.timed("heartbeat", lambda: self.store.heartbeat(self.owner,
                                                                 CONFIG.lease_seconds))
            self.next_heartbeat = now + self.heartbeat_every
        if now >= self.next_sweep:
            t0 = time.perf_counter_ns()
            held = frozenset(self.pending) if self.solo else None
            executing = frozenset() if self.solo else None
            self.timed("reconcile", lambda: self.store.reconcile(
                self.owner, lambda _pid: True, held, executing, 5.0, frozenset(),
                2 * CONFIG.store_retry_max + CONFIG.sweep_interval, CONFIG.lease_seconds))
            up_for = self.timed("up_for", self.store.up_for)
            ended: list[Ended] = []
            orphans = self.timed("claim_orphans", lambda: self.store.claim_orphans(
                self.owner, CONFIG.sweep_batch, CONFIG.submit_timeout, CONFIG.max_republish,
                CONFIG.republish_backoff_max, ended, CONFIG.lease_seconds,
                up_for is None or up_for >= CONFIG.lease_seconds))
            self.orphans += len(orphans) + len(ended)
            self.times["sweep"].append((time.perf_counter_ns() - t0) / 1e6)
            self.next_sweep = now + self.sweep_every


def child(idx: int, args: argparse.Namespace, url: str, prefix: str, incarnation: str,
          barrier: Any, results: Any) -> None:
    """One simulated pool process (runs in a forked child)."""
    try:
        store = Store(url, prefix)
        worker_idx = idx // args.procs_per_worker
        owner = Owner(f"load{worker_idx}@bench", incarnation, os.getpid())
        leader = idx % args.procs_per_worker == 0
        if leader:
            store.register(owner, f"bench:{os.getpid()}", CONFIG.lease_seconds)
        sim = SimWorker(store, owner, f"u{idx}-{uuid.uuid4().hex[:6]}", args.prefetch, leader,
                        args.procs_per_worker == 1, args.heartbeat_every, args.sweep_every)
        for _ in range(args.warmup):
            sim.unit()
        sim.times.clear()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        barrier.wait(timeout=120)
        start = time.monotonic()
        deadline = start + args.seconds
        units = 0
        while True:
            now = time.monotonic()
            if now >= deadline:
                break
            sim.maintain(now)
            sim.unit()
            units += 1
        elapsed = time.monotonic() - start
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        times = {op: list(v) for op, v in sim.times.items()}
        while sim.pending:  # a warm shutdown: run the received units, untimed
            sim.unit()
        if leader:  # no orphans left for the next level's sweeps
            store.mark_stopped(owner, CONFIG.submit_timeout)
        store.dispose()
        results.put({"idx": idx, "units": units, "elapsed": elapsed, "cpu": cpu,
                     "orphans": sim.orphans, "times": times})
    except BaseException:
        results.put({"idx": idx, "error": traceback.format_exc()})


class _Sampler:
    """A thread that takes one sample every ``interval`` seconds from start to stop."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self.samples += 1
            self._stop.wait(self.interval)

    def sample(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class PgView(_Sampler):
    """PostgreSQL's counters and sampled pg_stat_activity over one measurement window."""

    def __init__(self, dsn: str, tag: str, interval: float = 0.1) -> None:
        super().__init__(interval)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.tag = tag
        self.states: Counter[str] = Counter()
        self.waits: Counter[str] = Counter()
        self.lock_waits = 0

    def counters(self) -> dict[str, float]:
        row = self.conn.execute(
            "SELECT xact_commit, xact_rollback, deadlocks, blks_hit, blks_read "
            "FROM pg_stat_database WHERE datname = current_database()").fetchone()
        wal = self.conn.execute("SELECT wal_records, wal_bytes, wal_write, wal_sync "
                                "FROM pg_stat_wal").fetchone()
        assert row is not None and wal is not None
        names = ("commits", "rollbacks", "deadlocks", "blks_hit", "blks_read",
                 "wal_records", "wal_bytes", "wal_writes", "wal_syncs")
        return dict(zip(names, (float(v) for v in (*row, *wal)), strict=True))

    def sample(self) -> None:
        rows = self.conn.execute(
            "SELECT state, wait_event_type, wait_event FROM pg_stat_activity "
            "WHERE application_name = %s", (self.tag,)).fetchall()
        for state, wtype, wevent in rows:
            self.states[state or "?"] += 1
            if state == "active":
                self.waits[f"{wtype}:{wevent}" if wtype else "CPU (no wait)"] += 1
                if wtype == "Lock":
                    self.lock_waits += 1

    def close(self) -> None:
        self.conn.close()

    def sampled(self) -> dict[str, Any]:
        return {"states": {k: v / max(self.samples, 1) for k, v in self.states.items()},
                "waits": self.waits, "lock_waits": self.lock_waits / max(self.samples, 1),
                "samples": self.samples}


class MySQLView(_Sampler):
    """MySQL/MariaDB's global status counters over one window, ``Threads_running`` sampled.

    Server-wide, unlike ``pg_stat_database``: other clients of the server count too."""

    COUNTERS = {"commits": "Handler_commit", "commit_statements": "Com_commit",
                "rollbacks": "Handler_rollback",
                "log_fsyncs": "Innodb_os_log_fsyncs", "log_writes": "Innodb_log_writes",
                "fsyncs": "Innodb_data_fsyncs", "log_bytes": "Innodb_os_log_written",
                "row_lock_waits": "Innodb_row_lock_waits", "row_lock_ms": "Innodb_row_lock_time",
                "deadlocks": "Innodb_deadlocks"}

    def __init__(self, url: str, interval: float = 0.1) -> None:
        super().__init__(interval)
        self.engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        self.conn = self.engine.connect()
        self.running = 0.0
        self.connected_max = 0

    def counters(self) -> dict[str, float]:
        status: dict[str, str] = dict(self.conn.exec_driver_sql("SHOW GLOBAL STATUS").all())
        # A counter this server lacks (Innodb_os_log_fsyncs on MariaDB >= 10.8) stays absent.
        return {k: float(status[v]) for k, v in self.COUNTERS.items() if v in status}

    def sample(self) -> None:
        status: dict[str, str] = dict(self.conn.exec_driver_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN "
            "('Threads_running', 'Threads_connected')").all())
        self.running += int(status["Threads_running"]) - 1  # less this query's own
        self.connected_max = max(self.connected_max, int(status["Threads_connected"]))

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()

    def sampled(self) -> dict[str, Any]:
        return {"running": self.running / max(self.samples, 1),
                "connected_max": self.connected_max, "samples": self.samples}


class ServerView(Protocol):
    """What ``run_level`` needs of a server's view of a window (``PgView``, ``MySQLView``)."""

    def counters(self) -> dict[str, float]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...

    def sampled(self) -> dict[str, Any]: ...


def cpu_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields), idle


def run_level(args: argparse.Namespace, procs: int, url: str, prefix: str,
              open_view: Callable[[], ServerView]) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    workers = -(-procs // args.procs_per_worker)
    incarnations = [uuid.uuid4().hex for _ in range(workers)]
    kids = [ctx.Process(target=child, args=(i, args, url, prefix,
                                            incarnations[i // args.procs_per_worker],
                                            barrier, results), daemon=True)
            for i in range(procs)]
    for k in kids:
        k.start()
    view = open_view()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(timeout=180)
    before = view.counters()
    cpu0 = cpu_busy()
    view.start()
    t0 = time.monotonic()
    time.sleep(args.seconds)
    view.stop()
    cpu1 = cpu_busy()
    window = time.monotonic() - t0
    out = [results.get(timeout=120) for _ in kids]
    for k in kids:
        k.join(timeout=30)
    time.sleep(0.5)  # backends flush their statistics when they exit
    after = view.counters()
    sampled = view.sampled()
    view.close()
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} process(es) failed; first:\n{errors[0]}")
    times: dict[str, list[float]] = defaultdict(list)
    for r in out:
        for op, values in r["times"].items():
            times[op].extend(values)
    total, idle = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    delta = {k: after[k] - before[k] for k in after}
    elapsed = max(r["elapsed"] for r in out)
    return {
        "procs": procs, "workers": workers,
        "units": sum(r["units"] for r in out), "elapsed": elapsed,
        "units_s": sum(r["units"] for r in out) / elapsed,
        "times": times, "orphans": sum(r["orphans"] for r in out),
        "client_cpu": sum(r["cpu"] for r in out) / window / (os.cpu_count() or 1),
        "cpu_busy": 1 - idle / total if total else 0.0,
        "server": delta, "window": window, **sampled,
    }


def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{percentile(values, 50):.2f} / {percentile(values, 99):.2f}"


def tables(levels: list[dict[str, Any]], name: str) -> str:
    """The store's own tables, headed with its name: units/s and latency, the sweep's parts."""
    base = levels[0]["units_s"] / levels[0]["procs"] if levels else 1.0
    lat = []
    for r in levels:
        t = r["times"]
        lat.append([r["procs"], r["workers"], f"{r['units_s']:.0f}",
                    f"{r['units_s'] / r['procs'] / base:.2f}",
                    fmt(t["take"]), fmt(t["save"]), fmt(t["finish"]), fmt(t["unit"]),
                    fmt(t["receipts"]), fmt(t["heartbeat"]), fmt(t["sweep"]),
                    len(t["sweep"])])
    out = [f"### {name}: units/s and latency (ms, p50 / p99)\n", markdown_table(
        ["procs", "workers", "units/s", "per-proc efficiency", "take", "checkpoint save",
         "finish", "unit (take..finish)", "receipts (batch)", "heartbeat",
         "sweep (reconcile+up_for+claim_orphans)", "sweeps"], lat)]
    sweep = [[r["procs"], fmt(r["times"]["reconcile"]), fmt(r["times"]["up_for"]),
              fmt(r["times"]["claim_orphans"]), r["orphans"]] for r in levels]
    out += [f"\n### {name}: the sweep's parts (ms, p50 / p99)\n", markdown_table(
        ["procs", "reconcile", "up_for", "claim_orphans", "orphans found (expect 0)"], sweep)]
    return "\n".join(out)


def pg_table(levels: list[dict[str, Any]]) -> str:
    pg = []
    for r in levels:
        d, w = r["server"], r["elapsed"]
        active = r["states"].get("active", 0.0)
        top = r["waits"].most_common(4)
        n = sum(r["waits"].values()) or 1
        pg.append([r["procs"], f"{d['commits'] / w:.0f}", f"{d['wal_syncs'] / w:.0f}",
                   f"{d['commits'] / max(d['wal_syncs'], 1):.1f}",
                   f"{d['wal_bytes'] / w / 1e6:.2f}", int(d["rollbacks"]), int(d["deadlocks"]),
                   f"{active:.1f}", f"{r['states'].get('idle in transaction', 0.0):.1f}",
                   f"{r['states'].get('idle', 0.0):.1f}",
                   ", ".join(f"{k} {v / n:.0%}" for k, v in top),
                   f"{r['lock_waits']:.2f}",
                   f"{r['cpu_busy']:.0%}", f"{r['client_cpu']:.0%}"])
    return "\n".join(["### PostgreSQL's view of the same window\n", markdown_table(
        ["procs", "commits/s", "WAL flushes/s", "commits per flush", "WAL MB/s", "rollbacks",
         "deadlocks", "backends active (mean)", "idle in txn (mean)", "idle (mean)",
         "active backends were in (share of samples)", "waiting on a lock (mean)",
         "machine CPU busy", "simulated workers' CPU share"], pg)])


def mysql_table(levels: list[dict[str, Any]], name: str) -> str:
    """The server's view from SHOW GLOBAL STATUS deltas (server-wide, see the docstring)."""
    rows = []
    flushes_by = "Innodb_os_log_fsyncs"
    for r in levels:
        d, w = r["server"], r["elapsed"]
        if "log_fsyncs" not in d:  # MariaDB >= 10.8: one log write per group commit
            flushes_by = "Innodb_log_writes"
        flushes = d.get("log_fsyncs", d.get("log_writes", 0.0))
        waits = d.get("row_lock_waits", 0.0)
        rows.append([r["procs"], f"{d['commits'] / w:.0f}",
                     f"{d.get('commit_statements', 0.0) / w:.0f}", f"{flushes / w:.0f}",
                     f"{d['commits'] / max(flushes, 1):.1f}",
                     f"{d['fsyncs'] / w:.0f}" if "fsyncs" in d else "-",
                     f"{d['log_bytes'] / w / 1e6:.2f}" if "log_bytes" in d else "-",
                     int(d["rollbacks"]),
                     f"{int(waits)} ({d.get('row_lock_ms', 0.0) / max(waits, 1):.0f} ms mean)",
                     int(d["deadlocks"]) if "deadlocks" in d else "-",
                     f"{r['running']:.1f}", r["connected_max"],
                     f"{r['cpu_busy']:.0%}", f"{r['client_cpu']:.0%}"])
    return "\n".join([f"### {name}'s view of the same window (server-wide counters)\n",
                      markdown_table(
        ["procs", "commits/s (Handler_commit)", "COMMIT statements/s (Com_commit)",
         f"redo log flushes/s ({flushes_by})", "Handler_commits per flush",
         "InnoDB fsyncs/s (all files)", "redo MB/s", "rollbacks",
         "row lock waits (Innodb_row_lock_waits)", "deadlocks (Innodb_deadlocks)",
         "threads running (mean)", "threads connected (max)", "machine CPU busy",
         "simulated workers' CPU share"], rows)])


# -- session-state check --------------------------------------------------------------------

@contextlib.contextmanager
def capture(*engines: sqlalchemy.Engine) -> Iterator[list[str]]:
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


def hot_path_rate(store: Store, seconds: float) -> tuple[float, float]:
    """Units/s and unit p50 ms of one process running the hot path on ``store``."""
    owner = Owner("session@bench", uuid.uuid4().hex, os.getpid())
    store.register(owner, "bench", CONFIG.lease_seconds)
    sim = SimWorker(store, owner, f"s-{uuid.uuid4().hex[:6]}", 4, True, True, 1.0, 2.0)
    for _ in range(10):
        sim.unit()
    sim.times.clear()
    deadline = time.monotonic() + seconds
    units = 0
    while (now := time.monotonic()) < deadline:
        sim.maintain(now)
        sim.unit()
        units += 1
    return units / seconds, percentile(sim.times["unit"], 50)


def session_check(url: str, prefix: str, seconds: float) -> str:
    lines = ["### Session state on the hot path (could it run behind a transaction pooler?)\n"]
    store = Store(url, prefix)
    owner = Owner("capture@bench", uuid.uuid4().hex, os.getpid())
    seen: dict[str, int] = {}

    def prepared_now(_conn: Any, cursor: Any, *_: Any) -> None:
        # Asked on the same session right after each statement: what the driver prepared.
        rows = cursor.connection.execute(
            f"SELECT name, statement FROM pg_prepared_statements /* {PROBE} */").fetchall()
        for name, statement in rows:
            if PROBE not in statement:
                seen[name] = seen.get(name, 0) + 1

    for engine in store.engines:
        event.listen(engine, "after_cursor_execute", prepared_now)
    with capture(*store.engines) as statements:
        store.register(owner, "bench", CONFIG.lease_seconds)
        sim = SimWorker(store, owner, f"c-{uuid.uuid4().hex[:6]}", 4, True, True, 0.0, 0.0)
        sim.maintain(time.monotonic() + 1)
        for _ in range(12):  # as between two sweeps: 12 units, no reads
            sim.unit()
        with store.engine.connect() as conn:
            between = conn.exec_driver_sql(
                "SELECT name, left(regexp_replace(statement, '\\s+', ' ', 'g'), 70) "
                f"FROM pg_prepared_statements WHERE strpos(statement, '{PROBE}') = 0 "
                "ORDER BY name").all()
            conn.commit()  # not rollback(): psycopg forgets its prepared statements then
        sim.maintain(time.monotonic() + 1)  # the sweep's reads roll back
    for engine in store.engines:
        event.remove(engine, "after_cursor_execute", prepared_now)
    distinct = sorted(set(statements))
    found = {what: sorted({s.split("\n")[0][:90] for s in distinct if rx.search(s)})
             for what, rx in SESSION_STATE.items()}
    set_local = sorted({s.strip() for s in distinct if re.match(r"\s*SET\s+LOCAL", s, re.I)})
    with store.engine.connect() as conn:
        backend = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        prepared = conn.exec_driver_sql(
            "SELECT name, left(regexp_replace(statement, '\\s+', ' ', 'g'), 70) "
            f"FROM pg_prepared_statements WHERE strpos(statement, '{PROBE}') = 0 "
            "ORDER BY name").all()
        conn.rollback()
    pool_status = store.engine.pool.status()
    store.dispose()
    lines.append(f"- {len(statements)} statements executed ({len(distinct)} distinct) for "
                 f"register, a heartbeat and a sweep, 12 units (receipts, take, 3 saves, "
                 f"finish), a heartbeat and a sweep; pool after: {pool_status}.")
    for what, hits in found.items():
        lines.append(f"- {what}: " + ("none" if not hits else "; ".join(hits)))
    lines.append("- transaction-scoped settings (fine under transaction pooling): "
                 + (", ".join(f"`{s}`" for s in set_local) or "none"))
    lines.append(f"- server-side prepared statements on the pooled connection after 12 units "
                 f"without a sweep: {len(between)}"
                 + ("".join(f"\n  - `{n}`: `{s}...`" for n, s in between[:12])))
    lines.append(f"- ... and after the next sweep (backend {backend}): {len(prepared)}")
    lines.append(f"- prepared statements seen on the session after any statement of the run: "
                 f"{len(seen)}" + (f" ({', '.join(sorted(seen))})" if seen else "")
                 + " (psycopg 3 prepares a statement on its 5th execution, and forgets and "
                 "deallocates all of them at every ROLLBACK of an open transaction, which each "
                 "of the Store's reads ends with, e.g. the sweep's up_for)")
    # The same hot path three ways, one process each.
    rows = []
    pooled = Store(url, prefix)
    rows.append(["Store's own engines (pooled, no server-side prepared statements)",
                 *hot_path_rate(pooled, seconds)])
    pooled.dispose()
    fresh = Store(url, prefix)
    fresh._engine = _FixedEngine(create_engine(url, poolclass=NullPool))  # type: ignore[assignment]
    fresh._autocommit = _FixedEngine(create_engine(  # type: ignore[assignment]
        url, poolclass=NullPool, isolation_level="AUTOCOMMIT"))
    rows.append(["fresh connection per transaction (NullPool)", *hot_path_rate(fresh, seconds)])
    fresh.dispose()
    prepared_on = Store(url, prefix)
    prepared_on._engine = _FixedEngine(create_engine(  # type: ignore[assignment]
        url, pool_size=5, max_overflow=5, connect_args={"prepare_threshold": 5}))
    prepared_on._autocommit = _FixedEngine(create_engine(  # type: ignore[assignment]
        url, pool_size=2, max_overflow=3, isolation_level="AUTOCOMMIT",
        pool_reset_on_return=None, connect_args={"prepare_threshold": 5}))
    rows.append(["pooled, psycopg prepares after 5 uses (its default)",
                 *hot_path_rate(prepared_on, seconds)])
    prepared_on.dispose()
    lines.append("\nThe hot path (one process, with heartbeats and sweeps) on three engines; "
                 "every unit checked: take ran, 3 saves fenced, finish recorded:\n")
    lines.append(markdown_table(["engine", "units/s", "unit p50 ms"],
                                [[n, f"{u:.0f}", f"{p:.2f}"] for n, u, p in rows]))
    return "\n".join(lines)


def pg_settings(url: str) -> str:
    dsn = make_url(url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        settings = {n: conn.execute(f"SHOW {n}").fetchone()[0]  # type: ignore[index]
                    for n in ("server_version", "max_connections", "synchronous_commit",
                              "shared_buffers", "commit_delay")}
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def mysql_settings(url: str) -> tuple[str, str]:
    """The server's product name ("MariaDB" or "MySQL") and the settings that bear on commits."""
    names = ("innodb_flush_log_at_trx_commit", "sync_binlog", "log_bin", "max_connections",
             "innodb_buffer_pool_size", "tx_isolation", "transaction_isolation")
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            version = str(conn.exec_driver_sql("SELECT VERSION()").scalar_one())
            quoted = ", ".join(f"'{n}'" for n in names)
            settings: dict[str, str] = dict(conn.exec_driver_sql(
                f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({quoted})").all())
    finally:
        engine.dispose()
    name = "MariaDB" if "mariadb" in version.lower() else "MySQL"
    return name, f"version={version}, " + ", ".join(
        f"{n}={settings[n]}" for n in names if n in settings)


def measure_store(args: argparse.Namespace, kind: str, name: str,
                  levels: list[int]) -> list[dict[str, Any]]:
    """Every level against one store under a prefix of its own (dropped afterwards); prints the
    store's tables (and, on PostgreSQL, the session-state check first)."""
    prefix = f"ld{uuid.uuid4().hex[:8]}_"
    open_view: Callable[[], ServerView]
    if kind == "postgresql":
        tag = f"bench_load_{uuid.uuid4().hex[:6]}"
        base, url = args.pg_url, tagged(args.pg_url, tag)
        dsn = make_url(args.pg_url).set(drivername="postgresql").render_as_string(False)
        open_view = functools.partial(PgView, dsn, tag)
    else:
        base = url = args.mysql_url
        open_view = functools.partial(MySQLView, url)
    store = Store(base, prefix)
    try:
        store.migrate()
        store.dispose()
        if kind == "postgresql" and not args.no_session_check:
            print(session_check(url, prefix, args.session_seconds) + "\n", flush=True)
        results = []
        for procs in levels:
            results.append(run_level(args, procs, url, prefix, open_view))
            print(f"done: {name}, {procs} processes, {results[-1]['units_s']:.0f} units/s",
                  file=sys.stderr, flush=True)
        view = pg_table(results) if kind == "postgresql" else mysql_table(results, name)
        print(tables(results, name) + "\n\n" + view + "\n", flush=True)
        return results
    finally:
        drop_prefixed_tables(base, prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="many workers on one store: units/s and per-operation p50/p99 from 1 to "
                    "64 concurrent processes, with the server's view")
    parser.add_argument("--levels", default="1,4,16,64",
                        help="comma-separated numbers of concurrent simulated pool processes")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per level")
    parser.add_argument("--warmup", type=int, default=5, help="untimed units per process")
    parser.add_argument("--prefetch", type=int, default=4,
                        help="deliveries per receipt batch (record_receipts)")
    parser.add_argument("--procs-per-worker", type=int, default=1,
                        help="processes sharing one incarnation (only the first heartbeats "
                             "and sweeps)")
    parser.add_argument("--heartbeat-every", type=float, default=1.0,
                        help="seconds between a worker's lease renewals (library default 5)")
    parser.add_argument("--sweep-every", type=float, default=2.0,
                        help="seconds between a worker's sweeps (library default 5)")
    parser.add_argument("--pg-url", default=PG_URL)
    parser.add_argument("--mysql-url", default=MYSQL_URL)
    parser.add_argument("--stores", default="postgresql",
                        help="comma-separated, run in this order: postgresql, mysql")
    parser.add_argument("--no-session-check", action="store_true",
                        help="skip the session-state / NullPool check (PostgreSQL)")
    parser.add_argument("--session-seconds", type=float, default=4.0,
                        help="seconds per engine in the session-state check")
    parser.add_argument("--quick", action="store_true",
                        help="levels 1,4,16 for 4 s each, 2 s per engine in the session check")
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.seconds, args.session_seconds = "1,4,16", 4.0, 2.0
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    stores = [x.strip() for x in args.stores.split(",") if x.strip()]
    if not stores or set(stores) - set(STORES):
        parser.error(f"--stores: a comma-separated choice of {', '.join(STORES)}")
    print(f"machine: {machine()}")
    print(f"celery_resilient from {os.path.dirname(celery_resilient.__file__)}; SQLAlchemy "
          f"{sqlalchemy.__version__}; psycopg {psycopg.__version__}")
    names = {"postgresql": "PostgreSQL"}
    if "postgresql" in stores:
        print(f"PostgreSQL {pg_settings(args.pg_url)}")
    if "mysql" in stores:
        names["mysql"], settings = mysql_settings(args.mysql_url)
        print(f"{names['mysql']} {settings}")
    print(f"levels {levels}, {args.seconds:g} s each after {args.warmup} warm-up units per "
          f"process; receipts in batches of {args.prefetch}; {args.procs_per_worker} "
          f"process(es) per worker incarnation; heartbeat every {args.heartbeat_every:g} s, "
          f"sweep every {args.sweep_every:g} s per worker\n", flush=True)
    results = {kind: measure_store(args, kind, names[kind], levels) for kind in stores}
    print()
    for kind, runs in results.items():
        best = max(runs, key=lambda r: r["units_s"])
        print(f"peak, {names[kind]}: {best['units_s']:.0f} units/s at {best['procs']} "
              f"processes ({best['units_s'] * 5:.0f} hot-path store calls/s)")
    if {"postgresql", "mysql"} <= results.keys():
        pg = {r["procs"]: r["units_s"] for r in results["postgresql"]}
        print(f"same run, {names['mysql']} units/s / PostgreSQL units/s: " + ", ".join(
            f"{r['procs']} processes {r['units_s'] / pg[r['procs']]:.2f}"
            for r in results["mysql"] if pg.get(r["procs"])))
    return 0

if __name__ == "__main__":
    sys.exit(main())
