"""Flat at size: the PostgreSQL store's per-unit and maintenance costs with 1k vs 2M units stored.

What: for each size N, a store under a throwaway table prefix (created by the migrations,
dropped afterwards) is filled with N finished units: N ``work`` rows (``done``, with a result,
a stored broker message and a checkpoint) and N ``steps`` rows, spread over
``--fill-workers`` worker incarnations (``workers`` rows), like the history a fleet leaves behind.
One incarnation of the fill is still live, and the benchmark measures as that worker: it has
finished N / fill-workers units, as a worker that has been up for a long time. The fill is one
``INSERT ... SELECT ... FROM generate_series`` per table, then ``VACUUM ANALYZE``.

Then, with only the ``Store``'s public methods as the worker calls them:

- per unit (``--samples`` units): ``record_receipts`` (batch of 4), ``take`` (the fast path a
  receipt makes possible), three ``Checkpoint.save`` (the fenced upsert), ``finish``; and
  ``take`` of a key with no receipt yet (the careful path, ``--samples`` / 4 units);
- ``heartbeat`` (the incarnation's lease renewal; ``--maint-samples`` x 5);
- the maintainer's round (``--maint-samples`` each): ``reconcile`` as the long-lived worker
  (owner of N / fill-workers finished units) and as a freshly started one, ``up_for``,
  ``claim_orphans`` (the sweep; nothing is orphaned, so it finds nothing).

It prints p50/p99 per operation and size, and the ratio biggest/smallest (an operation is
"flat" when the p50 ratio is at most 1.2). At the biggest size it captures the SQL of take
(both paths), checkpoint save, finish, heartbeat, reconcile and claim_orphans (SQLAlchemy's
``before_cursor_execute``), replays each statement under ``EXPLAIN (ANALYZE, BUFFERS)`` inside
a transaction that is rolled back (key parameters point at a fresh unit in the right state),
prints the plans of take, reconcile and the sweep, and flags any sequential scan of a big
table. Note: psycopg 3 turns a statement run 5 times on one connection into a server-side
prepared statement, whose plan PostgreSQL may make generic; EXPLAIN shows the custom plan.

    PYTHONPATH=. python benchmarks/store_size.py [--sizes 1000,2000000]
    PYTHONPATH=. python benchmarks/store_size.py --sizes 1000,10000000   # the 10M case
    PYTHONPATH=. python benchmarks/store_size.py --quick     # 1000 vs 200000, < 60 s

PostgreSQL only. The default big size is 2,000,000, not 10,000,000: on the 2-core VM it was
written on, the fill runs at ~15k units/s (1M units = 3M rows, ~1 GB with indexes, in 68 s
including VACUUM ANALYZE), so 10M would take ~12 minutes before measuring anything; pass
``--sizes 1000,10000000`` for it. Markdown tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy
import sqlalchemy.exc
from bench_common import machine, markdown_table, percentile
from psycopg import sql as psycopg_sql
from sqlalchemy import event, text

import celery_resilient
from celery_resilient.core import codec
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.sql import Ended, Receipt, Store
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.execution import Execution
from celery_resilient.testing.services import drop_prefixed_tables

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TASK = "bench.store_size"
CONFIG = ResilientConfig()
LIVE_INC = "fill-inc-0"
LIVE_NODE = "fill-node-0@bench"
MESSAGE = json.dumps({"body": "W1tdLHt9LHsiY2FsbGJhY2tzIjpudWxsfV0=" * 4,
                      "headers": {"lang": "py", "task": TASK, "retries": 0},
                      "content-type": "application/json"})
FILL = {
    "work": """
        INSERT INTO {p}work (work_key, task_name, task_id, args_digest, state, epoch,
                             owner_node, incarnation, owner_pid, lease_expires_at, attempts,
                             deaths, republished, retries, message_json, result_json,
                             created_at, updated_at, finished_at, checkpoint_json,
                             checkpoint_seq, checkpoint_epoch, checkpoint_at)
        SELECT 'fill-' || g, 'bench.fill', 'fill-task-' || g, md5(g::text), 'done', 1,
               'fill-node-' || (g % :k) || '@bench', 'fill-inc-' || (g % :k), NULL, NULL, 1,
               0, 0, 0, :msg, '{{"rows": 3000}}', t - (:n - g) * 0.01, t - (:n - g) * 0.01,
               t - (:n - g) * 0.01, '{{"row": ' || g || ', "file": "customers.csv"}}', 3, 1,
               t - (:n - g) * 0.01
        FROM generate_series(1, :n) AS g, (SELECT extract(epoch FROM now()) AS t) AS clock""",
    "steps": """
        INSERT INTO {p}steps (work_key, name, epoch, result_json, created_at)
        SELECT 'fill-' || g, 'download', 1, '{{"path": "/data/' || g || '.csv"}}',
               extract(epoch FROM now())
        FROM generate_series(1, :n) AS g""",
    "workers": """
        INSERT INTO {p}workers (incarnation, node, pid, started_at, heartbeat_at, stopped_at,
                                lease_expires_at, process)
        SELECT 'fill-inc-' || g, 'fill-node-' || g || '@bench', 1000 + g, t - 86400, t,
               CASE WHEN g = 0 THEN NULL ELSE t END, t + 30, NULL
        FROM generate_series(0, :k - 1) AS g, (SELECT extract(epoch FROM now()) AS t) AS c""",
}
BIG_TABLES = ("work", "steps")
EXPLAIN_SHOWN = ("take", "take (no receipt)", "reconcile (long-lived worker)", "claim_orphans")


def fill(store: Store, n: int, workers: int) -> float:
    t0 = time.perf_counter()
    with store.begin() as conn:
        for statement in FILL.values():
            conn.execute(text(statement.format(p=store.prefix)),
                         {"n": n, "k": workers, "msg": MESSAGE})
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in ("work", "steps", "workers"):
            conn.execute(text(f"VACUUM ANALYZE {store.prefix}{table}"))
    return time.perf_counter() - t0


def table_sizes(store: Store) -> str:
    with store.engine.connect() as conn:
        size = conn.execute(text(
            "SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_class c "
            "WHERE c.relkind = 'r' AND c.relname LIKE :p"), {"p": store.prefix + "%"}
        ).scalar_one()
        conn.rollback()
    return str(size)


class Bench:
    """The operations of one worker against one filled store, timed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.owner = Owner(LIVE_NODE, LIVE_INC, os.getpid())
        self.fresh = Owner("fresh@bench", uuid.uuid4().hex, os.getpid())
        self.times: dict[str, list[float]] = defaultdict(list)
        self.n = 0
        store.register(self.owner, "bench", CONFIG.lease_seconds)
        store.register(self.fresh, "bench", CONFIG.lease_seconds)

    def timed(self, op: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter_ns()
        value = fn()
        self.times[op].append((time.perf_counter_ns() - t0) / 1e6)
        return value

    def keys(self, count: int) -> list[str]:
        self.n += count
        return [f"m-{uuid.uuid4().hex[:8]}-{self.n - count + i}" for i in range(count)]

    def receipt(self, keys: list[str]) -> None:
        self.timed("record_receipts (batch of 4)", lambda: self.store.record_receipts(
            [Receipt(k, TASK, k, None, MESSAGE) for k in keys], self.owner,
            CONFIG.lease_seconds))

    def take(self, key: str, op: str = "take") -> int:
        outcome = self.timed(op, lambda: self.store.take(
            key, TASK, key, None, self.owner, CONFIG.lease_seconds, CONFIG.max_attempts,
            is_live=lambda *_: False))
        assert outcome.claim is not None, outcome
        return int(outcome.claim.epoch)

    def saves(self, key: str, epoch: int) -> None:
        checkpoint = Checkpoint(Execution(self.store, CONFIG, key, epoch, 1))
        for i in range(3):
            self.timed("checkpoint save", lambda i=i: checkpoint.save({"row": i * 1000}))

    def finish(self, key: str, epoch: int) -> None:
        result = codec.encode({"rows": 3000}, "result")
        self.timed("finish", lambda: self.store.finish(key, epoch, result))

    def units(self, count: int) -> None:
        for start in range(0, count, 4):
            batch = self.keys(min(4, count - start))
            self.receipt(batch)
            for key in batch:
                epoch = self.take(key)
                self.saves(key, epoch)
                self.finish(key, epoch)

    def careful_takes(self, count: int) -> None:
        for key in self.keys(count):
            epoch = self.take(key, "take (no receipt)")
            self.finish(key, epoch)

    def heartbeat(self) -> None:
        self.timed("heartbeat", lambda: self.store.heartbeat(self.owner, CONFIG.lease_seconds))

    def reconcile(self, owner: Owner, op: str) -> None:
        self.timed(op, lambda: self.store.reconcile(
            owner, lambda _pid: True, frozenset(), frozenset(), 5.0, frozenset(),
            2 * CONFIG.store_retry_max + CONFIG.sweep_interval, CONFIG.lease_seconds))

    def sweep(self) -> None:
        up_for = self.timed("up_for", self.store.up_for)
        ended: list[Ended] = []
        orphans = self.timed("claim_orphans", lambda: self.store.claim_orphans(
            self.owner, CONFIG.sweep_batch, CONFIG.submit_timeout, CONFIG.max_republish,
            CONFIG.republish_backoff_max, ended, CONFIG.lease_seconds,
            up_for is None or up_for >= CONFIG.lease_seconds))
        assert not orphans and not ended, (orphans, ended)

    def maintenance(self, count: int) -> None:
        for _ in range(count):
            for _ in range(5):
                self.heartbeat()
            self.reconcile(self.owner, "reconcile (long-lived worker)")
            self.reconcile(self.fresh, "reconcile (fresh worker)")
            self.sweep()


# -- EXPLAIN ----------------------------------------------------------------------------------

@contextlib.contextmanager
def capture(*engines: sqlalchemy.Engine) -> Iterator[list[tuple[str, Any]]]:
    statements: list[tuple[str, Any]] = []

    def record(_c: Any, _cur: Any, statement: str, parameters: Any, _ctx: Any,
               executemany: bool) -> None:
        if not executemany:
            statements.append((statement, parameters))

    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


def substituted(params: Any, old: str | None, new: str | None) -> Any:
    if old is None or not isinstance(params, dict):
        return params
    return {k: new if v == old else v for k, v in params.items()}


def explain_op(store: Store, run: Callable[[], Any], old_key: str | None = None,
               new_key: str | None = None) -> list[tuple[str, list[str]]]:
    """Run ``run`` capturing its SQL, then EXPLAIN ANALYZE each statement (rolled back)."""
    with capture(*store.engines) as statements:
        run()
    plans = []
    seen: set[str] = set()
    for sql, params in statements:
        if sql in seen:
            continue
        seen.add(sql)
        if not re.match(r"\s*(SELECT|UPDATE|INSERT|DELETE|WITH)\b", sql, re.I) or \
                "pg_postmaster_start_time" in sql:
            continue
        bound = substituted(params, old_key, new_key)
        with store.engine.connect() as conn:
            lines = [r[0] for r in conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + sql,
                                                        bound)]
            conn.rollback()
        plans.append((sql, lines))
        generic = generic_plan(store, sql, bound)
        if generic:
            plans.append(("[generic plan, as a prepared statement may get] " + sql, generic))
    return plans


def generic_plan(store: Store, sql: str, params: Any) -> list[str]:
    """The plan PostgreSQL would use for ``sql`` as a prepared statement with a generic plan
    (psycopg prepares a statement on its 5th run on a connection). Rolled back."""
    if not isinstance(params, dict) or not params:
        return []
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    body = re.sub(r"%\(([^)]+)\)s", number, sql).replace("%%", "%")
    with store.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        args = ", ".join(psycopg_sql.Literal(params[n]).as_string(raw) for n in names)
        try:
            conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
            conn.exec_driver_sql(f"PREPARE bench_generic AS {body}")
            lines = [r[0] for r in conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_generic({args})")]
        except sqlalchemy.exc.DBAPIError as exc:
            lines = [f"(no generic plan: {str(exc.orig).splitlines()[0]})"]
        conn.rollback()
        with contextlib.suppress(sqlalchemy.exc.DBAPIError):
            conn.exec_driver_sql("DEALLOCATE bench_generic")
            conn.rollback()
    return lines


def seq_scans(store: Store, plan: list[str]) -> list[str]:
    big = tuple(store.prefix + t for t in BIG_TABLES)
    return [line.strip() for line in plan
            if "Seq Scan on" in line and any(f"Seq Scan on {t} " in line + " " for t in big)]


def explains(bench: Bench) -> dict[str, list[tuple[str, list[str]]]]:
    store = bench.store
    out: dict[str, list[tuple[str, list[str]]]] = {}
    a, b = bench.keys(2)
    bench.receipt([a, b])
    out["take"] = explain_op(store, lambda: bench.take(a), a, b)
    c = bench.keys(1)[0]
    bench.receipt([c])
    epoch_c = bench.take(c)
    epoch_b = bench.take(b)  # b was left reserved by the rolled-back replay: take it too
    epoch_a = epoch_c  # every key's first claim is epoch 1
    out["checkpoint save"] = explain_op(
        store, lambda: store.save_checkpoint(a, epoch_a, '{"row": 1}'), a, c)
    out["finish"] = explain_op(store, lambda: store.finish(a, epoch_a, "1"), a, c)
    store.finish(c, epoch_c, "1")
    store.finish(b, epoch_b, "1")
    d, e = bench.keys(2)
    out["take (no receipt)"] = explain_op(store, lambda: bench.take(d, "explain"), d, e)
    store.finish(d, 1, "1")
    out["heartbeat"] = explain_op(store, bench.heartbeat)
    out["reconcile (long-lived worker)"] = explain_op(
        store, lambda: bench.reconcile(bench.owner, "explain"))
    out["claim_orphans"] = explain_op(store, bench.sweep)
    return out


def short(sql: str) -> str:
    one = re.sub(r"\s+", " ", sql).strip()
    return one if len(one) <= 160 else one[:157] + "..."


def explain_report(store: Store, plans: dict[str, list[tuple[str, list[str]]]]) -> str:
    lines = []
    flagged = []
    for op, statements in plans.items():
        for sql, plan in statements:
            for scan in seq_scans(store, plan):
                flagged.append(f"- **{op}**: `{scan}` in `{short(sql)}`")
    lines.append("### Sequential scans of big tables at the biggest size\n")
    lines += flagged or ["- none"]
    lines.append("\n### Statements and their plans at the biggest size "
                 "(EXPLAIN (ANALYZE, BUFFERS), rolled back)\n")
    for op, statements in plans.items():
        lines.append(f"#### {op}\n")
        for sql, plan in statements:
            lines.append(f"`{short(sql)}`\n")
            if op in EXPLAIN_SHOWN:
                lines.append("```\n" + "\n".join(plan) + "\n```\n")
            else:
                timing = [x.strip() for x in plan if x.strip().startswith("Execution Time")]
                lines.append(f"- top node: `{plan[0].strip()}`; {', '.join(timing)}\n")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------

def measure(url: str, size: int, args: argparse.Namespace, explain: bool
            ) -> tuple[dict[str, list[float]], float, str, str]:
    prefix = f"sz{uuid.uuid4().hex[:8]}_"
    store = Store(url, prefix)
    try:
        store.migrate()
        print(f"filling {size:,} units ...", file=sys.stderr, flush=True)
        fill_s = fill(store, size, args.fill_workers)
        sizes = table_sizes(store)
        print(f"filled {size:,} units in {fill_s:.0f} s ({sizes})", file=sys.stderr, flush=True)
        bench = Bench(store)
        bench.units(args.warmup)
        bench.maintenance(2)
        bench.times.clear()
        bench.units(args.samples)
        bench.careful_takes(max(args.samples // 4, 20))
        bench.maintenance(args.maint_samples)
        times = {op: list(v) for op, v in bench.times.items()}
        report = explain_report(store, explains(bench)) if explain else ""
        return times, fill_s, sizes, report
    finally:
        store.dispose()
        drop_prefixed_tables(url, prefix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PostgreSQL store costs with few vs many finished units stored: take, "
                    "checkpoint save, finish, heartbeat, reconcile, sweep; ratio big/small "
                    "and EXPLAIN ANALYZE at the biggest size")
    parser.add_argument("--sizes", default="1000,2000000",
                        help="comma-separated numbers of finished units already stored")
    parser.add_argument("--samples", type=int, default=1000,
                        help="timed units per size (each: take, 3 saves, finish)")
    parser.add_argument("--warmup", type=int, default=100, help="untimed units per size")
    parser.add_argument("--maint-samples", type=int, default=20,
                        help="timed maintainer rounds per size (5 heartbeats, 2 reconciles, "
                             "up_for, claim_orphans each)")
    parser.add_argument("--fill-workers", type=int, default=10,
                        help="incarnations the fill spreads its units over; the measuring "
                             "worker is one of them")
    parser.add_argument("--pg-url", default=PG_URL)
    parser.add_argument("--no-explain", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="sizes 1000,200000, 300 units, 5 maintainer rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.samples, args.warmup, args.maint_samples = "1000,200000", 300, 50, 5
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    print(f"machine: {machine()}")
    print(f"celery_resilient from {os.path.dirname(celery_resilient.__file__)}; SQLAlchemy "
          f"{sqlalchemy.__version__}")
    print(f"sizes {sizes}; {args.samples} timed units and {max(args.samples // 4, 20)} "
          f"no-receipt takes per size after {args.warmup} warm-up units; {args.maint_samples} "
          f"maintainer rounds; fill over {args.fill_workers} incarnations (the measuring "
          f"worker owns 1/{args.fill_workers} of the finished units)\n", flush=True)
    results = []
    fills = []
    report = ""
    for i, size in enumerate(sizes):
        times, fill_s, table_size, rep = measure(args.pg_url, size, args,
                                                 not args.no_explain and i == len(sizes) - 1)
        results.append(times)
        fills.append([f"{size:,}", f"{fill_s:.0f}", table_size])
        report = rep or report
        print(f"done: {size:,} units stored", file=sys.stderr, flush=True)
    print("### Fill\n")
    print(markdown_table(["units stored", "fill + VACUUM ANALYZE s", "tables + indexes"], fills))
    header = ["operation"] + [f"{s:,}: p50 / p99 ms" for s in sizes]
    if len(sizes) > 1:
        header += ["ratio p50 big/small", "ratio p99 big/small", "flat (p50 ratio <= 1.2)"]
    rows = []
    for op in results[0]:
        row: list[object] = [op]
        for times in results:
            v = times.get(op, [])
            row.append(f"{percentile(v, 50):.2f} / {percentile(v, 99):.2f} (n={len(v)})"
                       if v else "-")
        if len(sizes) > 1 and results[-1].get(op):
            small, big = results[0][op], results[-1][op]
            r50 = percentile(big, 50) / percentile(small, 50)
            r99 = percentile(big, 99) / percentile(small, 99)
            row += [f"{r50:.2f}", f"{r99:.2f}", "yes" if r50 <= 1.2 else "**no**"]
        rows.append(row)
    print("\n### Latency by units stored\n")
    print(markdown_table(header, rows))
    print("\nheartbeat and up_for never read the big tables (workers: --fill-workers rows): "
          "their ratio is this run's noise floor on a shared machine.")
    if report:
        print("\n" + report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
