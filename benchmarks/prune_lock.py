"""How long automatic retention holds a transaction (and so its row locks) on PostgreSQL.

Fills a throwaway store with ``--rows`` finished units (work + checkpoint + two steps + a
ledger marker each, finished 30 days ago), 1000 open units and old worker rows, one
``INSERT ... SELECT ... FROM generate_series`` per table, then ``VACUUM ANALYZE``. Then:

1. ``EXPLAIN`` of every retention delete (the SQL as the store sends it, captured from the
   first batch), and whether any of them scans a big table sequentially;
2. the worker's own :class:`~celery_resilient.worker.pruner.Pruner` runs turns until the
   round ends, timing every batch: each batch is one transaction, so its duration is the
   longest any row lock of it is held;
3. meanwhile a probe thread updates an open work row (as a checkpoint's fence does) in a
   loop; its slowest update shows whether anything waited on the pruner.

Run: ``python benchmarks/prune_lock.py [--rows 200000] [--batch 500]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from typing import Any

from celery import Celery
from sqlalchemy import event, text

from celery_resilient import Resilient
from celery_resilient.store import retention
from celery_resilient.testing.services import drop_prefixed_tables
from celery_resilient.worker.pruner import Pruner

PG_URL = os.environ.get("RESILIENT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DAY = 86_400.0
FILL = (
    """INSERT INTO {p}work (work_key, task_name, task_id, state, epoch, attempts, deaths,
                            republished, retries, result_json, created_at, updated_at,
                            finished_at, incarnation, checkpoint_json, checkpoint_seq,
                            checkpoint_epoch, checkpoint_at)
       SELECT 'old-' || g, 'bench.task', 'tid-' || g, 'done', 1, 1, 0, 0, 0, '1',
              t - 31 * 86400, t - 30 * 86400 + g * 0.001, t - 30 * 86400 + g * 0.001,
              'fill-inc-' || (g % 50), '{{"row": ' || g || '}}', 3, 1, t - 30 * 86400
       FROM generate_series(1, :n) AS g, (SELECT extract(epoch FROM now()) AS t) AS c""",
    """INSERT INTO {p}work (work_key, task_name, task_id, state, epoch, attempts, deaths,
                            republished, retries, created_at, updated_at, lease_expires_at)
       SELECT 'open-' || g, 'bench.task', 'otid-' || g, 'running', 1, 1, 0, 0, 0,
              t - 31 * 86400, t - 31 * 86400, t + 3600
       FROM generate_series(1, 1000) AS g, (SELECT extract(epoch FROM now()) AS t) AS c""",
    """INSERT INTO {p}steps (work_key, name, epoch, result_json, created_at)
       SELECT 'old-' || g, s, 1, '{{"ok": true}}', extract(epoch FROM now())
       FROM generate_series(1, :n) AS g, (VALUES ('download'), ('notify')) AS v(s)""",
    """INSERT INTO {p}ledger (key, work_key, epoch, result_json, applied_at)
       SELECT 'effect-' || g, 'old-' || g, 1, '1', t - 40 * 86400 + g * 0.001
       FROM generate_series(1, :n) AS g, (SELECT extract(epoch FROM now()) AS t) AS c""",
    """INSERT INTO {p}workers (incarnation, node, pid, started_at, heartbeat_at, stopped_at,
                               lease_expires_at)
       SELECT 'fill-inc-' || g, 'node-' || g || '@bench', 1000 + g, t - 40 * 86400,
              t - 35 * 86400, t - 35 * 86400, t - 35 * 86400
       FROM generate_series(0, 49) AS g, (SELECT extract(epoch FROM now()) AS t) AS c""",
)
BIG = ("work", "steps", "ledger")


def fill(rt: Resilient, n: int) -> float:
    t0 = time.perf_counter()
    store = rt.store
    with store.begin() as conn:
        for statement in FILL:
            conn.execute(text(statement.format(p=store.prefix)), {"n": n})
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        for table in (*BIG, "workers"):
            conn.execute(text(f"VACUUM ANALYZE {store.prefix}{table}"))
    return time.perf_counter() - t0


def explain(rt: Resilient) -> list[tuple[str, str]]:
    """EXPLAIN of each retention delete, as sent by the store (one batch, rolled back)."""
    store = rt.store
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
                executemany: bool) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            captured.append((statement, parameters))

    cutoff = store.now() - 7 * DAY
    for engine in store.engines:
        event.listen(engine, "before_cursor_execute", capture)
    try:
        for fn in (retention.delete_finished_work, retention.delete_ledger_markers,
                   retention.delete_revocations, retention.delete_beat_runs,
                   retention.delete_contexts):
            _dry(store, fn, cutoff)  # the statements are captured, the deletes rolled back
        _dry_workers(store, cutoff, rt.config.lease_seconds)
    finally:
        for engine in store.engines:
            event.remove(engine, "before_cursor_execute", capture)
    plans = []
    with store.engine.connect() as conn:
        for statement, parameters in captured:
            rows = conn.exec_driver_sql("EXPLAIN " + statement, parameters).all()
            plans.append((statement, "\n".join(_short(r[0]) for r in rows)))
        conn.rollback()
    return plans


def _short(line: str, width: int = 160) -> str:
    return line if len(line) <= width else line[:width] + " ..."


class _Rollback(Exception):
    pass


def _dry(store: Any, fn: Any, cutoff: float) -> None:
    """Run one delete and roll it back (the transaction raises before its commit)."""
    original = store.begin

    def begin() -> Any:
        cm = original()

        class Wrapper:
            def __enter__(self) -> Any:
                return cm.__enter__()

            def __exit__(self, *exc: Any) -> Any:
                cm.__exit__(_Rollback, _Rollback(), None)
                raise _Rollback

        return Wrapper()

    store.begin = begin
    try:
        fn(store, cutoff, 500)
    except _Rollback:
        pass
    finally:
        del store.begin


def _dry_workers(store: Any, cutoff: float, lease: float) -> None:
    _dry(store, lambda s, c, b: retention.delete_ended_workers(s, c, lease, b), cutoff)


def probe(rt: Resilient, stop: threading.Event, out: list[float]) -> None:
    """Update open work rows (as a checkpoint's fence does) until stopped."""
    store = rt.store
    w = store.t.work
    i = 0
    while not stop.is_set():
        key = f"open-{1 + i % 1000}"
        t0 = time.perf_counter()
        with store.begin() as conn:
            conn.execute(w.update().where(w.c.work_key == key)
                         .values(updated_at=store.dialect.now()))
        out.append(time.perf_counter() - t0)
        i += 1


def run_round(rt: Resilient) -> None:
    """The worker's Pruner, turn after turn until its round ends, every batch timed."""
    timings: dict[str, list[float]] = {}
    originals = {}
    for name in ("delete_finished_work", "delete_ledger_markers", "delete_revocations",
                 "delete_ended_workers", "delete_beat_runs", "delete_contexts"):
        fn = getattr(retention, name)
        originals[name] = fn

        def timed(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                timings.setdefault(_name, []).append(time.perf_counter() - t0)

        setattr(retention, name, timed)
    pruner = Pruner(rt)
    probes: list[float] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(rt, stop, probes), daemon=True)
    prober.start()
    turns: list[float] = []
    t0 = time.perf_counter()
    try:
        pruner.turn()
        turns.append(time.perf_counter() - t0)
        while pruner.busy:
            t1 = time.perf_counter()
            pruner.turn()
            turns.append(time.perf_counter() - t1)
    finally:
        stop.set()
        prober.join()
        for name, fn in originals.items():
            setattr(retention, name, fn)
    total = time.perf_counter() - t0
    print(f"\nround: {total:.1f}s in {len(turns)} turns (longest turn {max(turns):.3f}s)")
    for name, ts in timings.items():
        print(f"  {name:24s} {len(ts):4d} batches  p50 {statistics.median(ts) * 1000:7.1f} ms"
              f"  max {max(ts) * 1000:7.1f} ms")
    longest = max(max(ts) for ts in timings.values())
    print(f"longest prune transaction (= longest row lock held): {longest * 1000:.1f} ms")
    print(f"probe (open-row update during the round): {len(probes)} updates, p50 "
          f"{statistics.median(probes) * 1000:.1f} ms, max {max(probes) * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--pg-url", default=PG_URL)
    args = parser.parse_args()
    prefix = f"bp{uuid.uuid4().hex[:8]}_"
    app = Celery("prune-bench", set_as_current=False)
    app.conf.update(resilient_store_url=args.pg_url, resilient_table_prefix=prefix,
                    resilient_auto_migrate=True, resilient_prune_batch=args.batch)
    rt = Resilient(app)
    try:
        print(f"fill: {args.rows} finished units (each with a checkpoint, 2 steps and a "
              f"ledger marker), 1000 open, 50 old worker rows: {fill(rt, args.rows):.1f}s")
        seq_scans = []
        for statement, plan in explain(rt):
            print("\n" + " ".join(statement.split())[:160] + " ...\n" + plan)
            for table in BIG:
                if f"Seq Scan on {prefix}{table} " in plan:
                    seq_scans.append(table)
        print(f"\nsequential scans of big tables: {seq_scans or 'none'}")

        run_round(rt)
        with rt.store.engine.connect() as conn:
            left = {t: conn.execute(text(f"SELECT count(*) FROM {prefix}{t}")).scalar_one()
                    for t in (*BIG, "workers")}
            conn.rollback()
        print(f"rows left: {left} (1000 open units stay)")
    finally:
        rt.store.dispose()
        drop_prefixed_tables(args.pg_url, prefix)


if __name__ == "__main__":
    main()
