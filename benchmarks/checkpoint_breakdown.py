"""Where a PostgreSQL checkpoint save spends its time: what-if variants, measured side by side.

Not a change to the library: each variant builds the store's engine differently in this process
only (``celery_resilient.store.engine.build_engine`` is replaced here), to size what each
round trip costs. Variants:

- ``as shipped``: the library's engines, ``Checkpoint.save`` (one fenced ``UPDATE`` of the
  work row, which holds the checkpoint, autocommitted), measured in alternation with the raw
  ``UPDATE`` below, sample by sample, so their ratio does not depend on the machine's drift;
- ``synchronous_commit=off``: the same without waiting for the WAL flush on commit;
- ``raw fenced UPDATE + commit``: the floor of a durable fenced write, psycopg alone: one
  ``UPDATE work ... WHERE work_key AND epoch AND state = 'running'`` in autocommit; the target
  is the save's p50 within 1.5 x this, measured in the same run;
- ``bare round trip``: one ``SELECT 1`` on a checked-out connection (the floor of any call).

Then the CPU per save, client and server, against what a user would hand-write instead of a
checkpoint: ``json.dumps`` of the state and an autocommitted ``INSERT ... ON CONFLICT DO
UPDATE`` of a progress row of their own, psycopg alone on one open connection; and the save
with a pool checkout each time, as before the process kept a connection (``store/pinned.py``).
Blocks of each alternate; the client's is this process's CPU time, the server's the CPU its
backends used (``/proc``, found by ``application_name``), so both see the same machine.

    python benchmarks/checkpoint_breakdown.py [--samples 3000] [--cpu-blocks 10]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench_common import markdown_table, median, percentile, process_cpu
from checkpoint_latency import claim, drop, timed
from sqlalchemy import Engine, create_engine, event, text

from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store import engine as engine_module
from celery_resilient.store.sql import Store


def variant_engine(sync_commit: bool) -> Callable[..., Engine]:
    def build(url: str, autocommit: bool = False) -> Engine:
        options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT",
                                   "pool_reset_on_return": None} if autocommit else {}
        engine = create_engine(url, pool_size=5, max_overflow=5,
                               connect_args={"connect_timeout": 5, "prepare_threshold": None},
                               **options)
        if not sync_commit:
            @event.listens_for(engine, "connect")
            def _async_commit(dbapi_conn: Any, _record: Any) -> None:
                with dbapi_conn.cursor() as cur:
                    cur.execute("SET synchronous_commit = off")
                dbapi_conn.commit()
        return engine

    return build


def run(url: str, samples: int, build: Callable[..., Engine] | None) -> list[float]:
    original = engine_module.build_engine
    if build is not None:
        engine_module.build_engine = build
    prefix = f"brk{uuid.uuid4().hex[:8]}_"
    store = Store(url, prefix)
    try:
        store.migrate()
        config = ResilientConfig.from_mapping({"resilient_store_url": url,
                                               "resilient_table_prefix": prefix})
        checkpoint = claim(store, config, "bench-key")
        for i in range(300):
            checkpoint.save({"row": i})
        return [timed(lambda i=i: checkpoint.save({"row": i})) for i in range(samples)]
    finally:
        drop(store)
        engine_module.build_engine = original


def shipped_against_raw(url: str, samples: int) -> tuple[list[float], list[float]]:
    """``Checkpoint.save`` and a fenced UPDATE + commit on psycopg alone, sample by sample in
    alternation (the order of each pair at random) against one claimed row of a real store,
    so both see the same machine: the ratio the target is about, not the machine's drift."""
    import psycopg

    prefix = f"brk{uuid.uuid4().hex[:8]}_"
    store = Store(url, prefix)
    try:
        store.migrate()
        config = ResilientConfig.from_mapping({"resilient_store_url": url,
                                               "resilient_table_prefix": prefix})
        checkpoint = claim(store, config, "bench-key")
        epoch = checkpoint._x.epoch
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            sql = (f"UPDATE {prefix}work SET updated_at = extract(epoch from clock_timestamp()) "
                   "WHERE work_key = %s AND epoch = %s AND state = 'running'")
            for i in range(300):
                conn.execute(sql, ("bench-key", epoch))
                checkpoint.save({"row": i})
            shipped: list[float] = []
            raw: list[float] = []
            for i in range(samples):
                pair = [(shipped, lambda i=i: checkpoint.save({"row": i})),
                        (raw, lambda: conn.execute(sql, ("bench-key", epoch)))]
                random.shuffle(pair)
                for into, fn in pair:
                    into.append(timed(fn))
            return shipped, raw
    finally:
        drop(store)


def bare_round_trip(url: str, samples: int) -> list[float]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            for _ in range(300):
                conn.execute(text("SELECT 1"))
            return [timed(lambda: conn.execute(text("SELECT 1"))) for _ in range(samples)]
    finally:
        engine.dispose()


def with_application_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


def backend_pids(conn: Any, name: str) -> list[int]:
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                        (name,)).fetchall()
    return [int(r[0]) for r in rows]


def cpu_per_save(url: str, blocks: int, block: int) -> dict[str, list[tuple[float, float]]]:
    """(client ms, server ms) per save of each block: ``Checkpoint.save`` on the process's
    kept connection, the same through a pool checkout per save, and a hand-written progress
    upsert, blocks alternating in random order."""
    import psycopg

    tag = uuid.uuid4().hex[:8]
    ours_name, raw_name = f"ckbrk_ours_{tag}", f"ckbrk_raw_{tag}"
    prefix = f"brk{tag}_"
    store = Store(with_application_name(url, ours_name), prefix)
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    try:
        store.migrate()
        config = ResilientConfig.from_mapping({"resilient_store_url": store.url,
                                               "resilient_table_prefix": prefix})
        checkpoint = claim(store, config, "bench-key")
        with psycopg.connect(with_application_name(dsn, raw_name), autocommit=True,
                             prepare_threshold=None) as conn, \
                psycopg.connect(dsn, autocommit=True) as monitor:
            conn.execute(f"CREATE TABLE {prefix}progress (key text PRIMARY KEY, state text, "
                         "updated_at double precision)")
            upsert = (f"INSERT INTO {prefix}progress (key, state, updated_at) VALUES (%s, %s, "
                      "extract(epoch from clock_timestamp())) ON CONFLICT (key) DO UPDATE SET "
                      "state = excluded.state, updated_at = excluded.updated_at")

            kept = store._pinned

            def ours(i: int) -> None:
                store._pinned = kept
                checkpoint.save({"row": i})

            def ours_pooled(i: int) -> None:
                store._pinned = None
                checkpoint.save({"row": i})

            def raw(i: int) -> None:
                conn.execute(upsert, ("bench-key", json.dumps({"row": i})))

            for i in range(300):
                ours(i)
                raw(i)
            for i in range(300):
                ours_pooled(i)
            ours_pids = backend_pids(monitor, ours_name)
            pids = {"ours": ours_pids, "ours_pooled": ours_pids,
                    "raw": backend_pids(monitor, raw_name)}
            out: dict[str, list[tuple[float, float]]] = {"ours": [], "ours_pooled": [],
                                                         "raw": []}
            for _ in range(blocks):
                pair = [("ours", ours), ("ours_pooled", ours_pooled), ("raw", raw)]
                random.shuffle(pair)
                for name, fn in pair:
                    server0 = sum(process_cpu(p) for p in pids[name])
                    client0 = time.process_time()
                    for i in range(block):
                        fn(i)
                    client = time.process_time() - client0
                    server = sum(process_cpu(p) for p in pids[name]) - server0
                    out[name].append((client * 1000 / block, server * 1000 / block))
            return out
    finally:
        drop(store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--cpu-blocks", type=int, default=10,
                        help="blocks of 1,000 saves each way for the CPU per save (0: skip)")
    args = parser.parse_args(argv)
    shipped, raw = shipped_against_raw(args.pg_url, args.samples)
    cases = [
        ("as shipped: Checkpoint.save", shipped),
        ("raw fenced UPDATE + commit (psycopg)", raw),
        ("Checkpoint.save, synchronous_commit=off",
         run(args.pg_url, args.samples, variant_engine(False))),
        ("bare round trip (SELECT 1)", bare_round_trip(args.pg_url, args.samples)),
    ]
    floor = percentile(cases[1][1], 50)
    print(markdown_table(
        ["PostgreSQL checkpoint save", "p50 ms", "p99 ms", "mean ms", "p50 / raw fenced"],
        [(name, f"{percentile(v, 50):.3f}", f"{percentile(v, 99):.3f}",
          f"{sum(v) / len(v):.3f}", f"{percentile(v, 50) / floor:.2f}")
         for name, v in cases]))
    if args.cpu_blocks:
        cpu = cpu_per_save(args.pg_url, args.cpu_blocks, 1000)
        rows = []
        for name, label in (("ours", "Checkpoint.save"),
                            ("ours_pooled", "Checkpoint.save, a pool checkout per save "
                             "(the kept connection off)"),
                            ("raw", "hand-written progress upsert (json.dumps + psycopg)")):
            client = median([c for c, _ in cpu[name]])
            server = median([s for _, s in cpu[name]])
            raw_client = median([c for c, _ in cpu["raw"]])
            raw_server = median([s for _, s in cpu["raw"]])
            rows.append((label, f"{client:.3f}", f"{server:.3f}",
                         f"{client / raw_client:.2f}", f"{server / raw_server:.2f}"))
        print()
        print(markdown_table(
            ["CPU per save (median of blocks)", "client ms", "server ms",
             "client / hand-written", "server / hand-written"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
