"""Continuity context latency (p50/p99): cache-hit get, cache-miss (recovered) get, put.

Measures ``ContextStore`` as tasks use it, one process, warm pools, PostgreSQL store, with
the Redis cache (DB 9 of the local server, a namespace of its own) and, for comparison, the
in-process LRU (whose hits confirm the version with the store) and the store alone.

    python benchmarks/context_latency.py [--samples 3000] [--turns 20]

"hit": ``get`` of a cached context. "miss (recovered)": ``get`` after the cache entry was
invalidated (untimed), so it reads the store and refills the cache. "put": compare-and-set
write (store transaction, then cache update). The context is a session of ``--turns`` turns
(about 60 bytes each). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable

import redis
from bench_common import machine, markdown_table, percentile
from celery import Celery
from sqlalchemy import inspect, text

from celery_resilient import ContextStore, Resilient
from celery_resilient.core import codec
from celery_resilient.store.contexts import ContextRows
from celery_resilient.store.sql import Store


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


def session(turns: int) -> dict[str, object]:
    return {"user": "u-123", "turns": [{"role": "user", "text": f"message number {i:04d}"}
                                      for i in range(turns)]}


def measure(pg_url: str, cache_url: str, samples: int, warmup: int, turns: int) -> list[object]:
    prefix = f"ctxlat{uuid.uuid4().hex[:8]}_"
    app = Celery("bench", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url=pg_url, resilient_table_prefix=prefix,
                    resilient_context_cache_url=cache_url)
    rt = Resilient(app)
    migrator = Store(pg_url, prefix)
    migrator.migrate()
    migrator.dispose()
    cs = ContextStore(app)
    data = session(turns)
    size = len(codec.encode(data))
    try:
        cs.create("bench", data)
        for _ in range(warmup):
            cs.get("bench")
        hits = [timed(lambda: cs.get("bench")) for _ in range(samples)]
        version = cs.get("bench").version
        puts = []
        for _ in range(samples):
            puts.append(timed(lambda v=version: cs.put("bench", data, expected_version=v)))
            version += 1
        misses = []
        for _ in range(samples):
            if cs._redis is not None:
                cs._redis.invalidate("bench")
            elif cs._local is not None:
                cs._local.drop("bench")
            misses.append(timed(lambda: cs.get("bench")))
        stats = cs.stats.as_dict()
    finally:
        cs.close()
        drop(pg_url, prefix, rt)
        if cache_url.startswith("redis"):
            client = redis.Redis.from_url(cache_url)
            keys = list(client.scan_iter(match=f"{prefix}*"))
            if keys:
                client.delete(*keys)
            client.close()
    kind = "Redis" if cache_url.startswith("redis") else "in-process LRU"
    assert stats["cache_errors"] == 0, stats
    return [kind, size,
            f"{percentile(hits, 50):.3f}", f"{percentile(hits, 99):.3f}",
            f"{percentile(misses, 50):.3f}", f"{percentile(misses, 99):.3f}",
            f"{percentile(puts, 50):.3f}", f"{percentile(puts, 99):.3f}"]


def store_only(pg_url: str, samples: int, turns: int) -> list[object]:
    """The floor a cache must beat: one primary-key read of the row, decoded."""
    prefix = f"ctxlat{uuid.uuid4().hex[:8]}_"
    store = Store(pg_url, prefix)
    store.migrate()
    rows = ContextRows(store)
    try:
        rows.create("bench", codec.encode(session(turns)))

        def read() -> object:
            row = rows.read("bench")
            assert row is not None
            return codec.decode(row.data_json)

        for _ in range(200):
            read()
        reads = [timed(read) for _ in range(samples)]
    finally:
        with store.begin() as conn:
            for name in inspect(conn).get_table_names():
                if name.startswith(prefix):
                    conn.execute(text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))
        store.dispose()
    return ["store only (no cache)", "", f"{percentile(reads, 50):.3f}",
            f"{percentile(reads, 99):.3f}", "", "", "", ""]


def drop(pg_url: str, prefix: str, rt: Resilient) -> None:
    store = rt.store
    with store.begin() as conn:
        for name in inspect(conn).get_table_names():
            if name.startswith(prefix):
                conn.execute(text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))
    store.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="context get/put latency p50/p99")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(f"{args.samples} timed calls per column after {args.warmup} warm-up gets; "
          f"PostgreSQL store; times in ms\n", flush=True)
    table = [measure(args.pg_url, url, args.samples, args.warmup, args.turns)
             for url in (args.redis_url, "memory://")]
    table.append(store_only(args.pg_url, args.samples, args.turns))
    print(markdown_table(
        ["cache", "context bytes", "hit get p50", "hit get p99", "miss (recovered) get p50",
         "miss (recovered) get p99", "put p50", "put p99"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
