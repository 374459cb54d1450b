"""Checkpoint save latency (p50/p99) with 1k and 1M rows already stored, PostgreSQL, SQLite
and MySQL/MariaDB (``--stores postgresql,sqlite,mysql``).

Measures ``self.checkpoint.save(state)`` as a task body calls it: the library's ``Checkpoint``
handle on a real claim (``Store.take``), warm connection pool, one process, the store's real
schema (created by its migrations). Before timing, the store is filled with N finished works,
each with a checkpoint (``work`` rows; a checkpoint is part of its work row), inserted in one
statement: ``INSERT ... SELECT ... FROM generate_series`` on PostgreSQL, a recursive CTE on SQLite
and MySQL.

    python benchmarks/checkpoint_latency.py [--rows 1000,1000000] [--samples 3000]
    python benchmarks/checkpoint_latency.py --stores postgresql,mysql --mysql-url ...

Each save is timed with ``perf_counter_ns``. "update" is a save of a work that already has a
checkpoint (every save after a task's first); "first save" inserts the work's checkpoint row.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy
from bench_common import machine, markdown_table, percentile
from sqlalchemy import create_engine, inspect, text

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.sql import Store
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.execution import Execution
from celery_resilient.testing.services import drop_prefixed_tables

OWNER = Owner("bench@localhost", uuid.uuid4().hex, 0)

PG_FILL = {
    "work": """
        INSERT INTO {p}work (work_key, task_name, task_id, state, epoch, attempts, deaths,
                             republished, result_json, created_at, updated_at, finished_at,
                             checkpoint_json, checkpoint_seq, checkpoint_epoch, checkpoint_at)
        SELECT 'fill-' || g, 'bench.fill', 'fill-' || g, 'done', 1, 1, 0, 0, '1',
               extract(epoch from now()), extract(epoch from now()), extract(epoch from now()),
               '{{"row": ' || g || ', "cursor": "customers.csv:' || g || '"}}', 1, 1,
               extract(epoch from now())
        FROM generate_series(1, :n) AS g""",
}
SQLITE_FILL = {
    "work": """
        WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < :n)
        INSERT INTO {p}work (work_key, task_name, task_id, state, epoch, attempts, deaths,
                             republished, result_json, created_at, updated_at, finished_at,
                             checkpoint_json, checkpoint_seq, checkpoint_epoch, checkpoint_at)
        SELECT 'fill-' || g, 'bench.fill', 'fill-' || g, 'done', 1, 1, 0, 0, '1',
               unixepoch(), unixepoch(), unixepoch(),
               '{{"row": ' || g || ', "cursor": "customers.csv:' || g || '"}}', 1, 1,
               unixepoch() FROM s""",
}


MYSQL_FILL = {
    "work": """
        INSERT INTO {p}work (work_key, task_name, task_id, state, epoch, attempts, deaths,
                             republished, result_json, created_at, updated_at, finished_at,
                             checkpoint_json, checkpoint_seq, checkpoint_epoch, checkpoint_at)
        WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < :n)
        SELECT CONCAT('fill-', g), 'bench.fill', CONCAT('fill-', g), 'done', 1, 1, 0, 0, '1',
               UNIX_TIMESTAMP(), UNIX_TIMESTAMP(), UNIX_TIMESTAMP(),
               CONCAT('{{"row": ', g, ', "cursor": "customers.csv:', g, '"}}'), 1, 1,
               UNIX_TIMESTAMP() FROM s""",
}


def fill(store: Store, rows: int) -> float:
    """Insert ``rows`` finished works and checkpoints; return the seconds it took."""
    sql = (SQLITE_FILL if store.dialect.is_sqlite else MYSQL_FILL if store.dialect.is_mysql
           else PG_FILL)
    t0 = time.perf_counter()
    with store.begin() as conn:
        if store.dialect.is_mysql:  # the recursion is the row count
            conn.execute(text("SET SESSION max_recursive_iterations = :n"
                              if conn.dialect.is_mariadb  # type: ignore[attr-defined]
                              else "SET SESSION cte_max_recursion_depth = :n"), {"n": rows + 1})
        for statement in sql.values():
            conn.execute(text(statement.format(p=store.prefix)), {"n": rows})
    if store.dialect.is_mysql:
        with store.engine.connect() as conn:
            conn.execute(text(f"ANALYZE TABLE {store.prefix}work")).all()
    elif not store.url.startswith("sqlite"):
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"VACUUM ANALYZE {store.prefix}work"))
    return time.perf_counter() - t0


def claim(store: Store, config: ResilientConfig, key: str) -> Checkpoint:
    outcome = store.take(key, "bench.latency", key, None, OWNER, config.lease_seconds,
                         config.max_attempts, is_live=lambda *_: False)
    assert outcome.claim is not None, outcome
    return Checkpoint(Execution(store, config, key, outcome.claim.epoch, outcome.claim.attempts))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


def measure(url: str, rows: int, samples: int, warmup: int, first_saves: int) -> list[object]:
    prefix = f"lat{uuid.uuid4().hex[:8]}_"
    store = Store(url, prefix)
    config = ResilientConfig.from_mapping({"resilient_store_url": url,
                                           "resilient_table_prefix": prefix})
    try:
        store.migrate()
        fill_s = fill(store, rows)
        checkpoint = claim(store, config, "bench-key")
        for i in range(warmup):
            checkpoint.save({"row": i, "cursor": f"customers.csv:{i}"})
        updates = [timed(lambda i=i: checkpoint.save({"row": i, "cursor": f"customers.csv:{i}"}))
                   for i in range(samples)]
        handles = [claim(store, config, f"bench-first-{j}") for j in range(first_saves)]
        firsts = [timed(lambda h=h: h.save({"row": 1, "cursor": "customers.csv:1"}))
                  for h in handles]
        with store.engine.connect() as conn:
            stored = conn.execute(text(f"SELECT count(*) FROM {prefix}work "
                                       "WHERE checkpoint_json IS NOT NULL")).scalar_one()
    finally:
        drop(store)
    backend = ("SQLite file" if url.startswith("sqlite") else
               "MySQL/MariaDB" if url.startswith("mysql") else "PostgreSQL")
    return [backend, f"{rows:,}", f"{stored:,}", f"{fill_s:.1f}",
            f"{percentile(updates, 50):.3f}", f"{percentile(updates, 99):.3f}",
            f"{sum(updates) / len(updates):.3f}",
            f"{percentile(firsts, 50):.3f}", f"{percentile(firsts, 99):.3f}"]


def drop(store: Store) -> None:
    if store.url.startswith("sqlite"):
        store.dispose()
        return
    if store.dialect.is_mysql:
        store.dispose()
        drop_prefixed_tables(store.url, store.prefix)
        return
    with store.begin() as conn:
        for name in inspect(conn).get_table_names():
            if name.startswith(store.prefix):
                conn.execute(text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))
    store.dispose()


def pg_settings(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            values = {name: conn.execute(text(f"SHOW {name}")).scalar_one()
                      for name in ("server_version", "synchronous_commit", "fsync",
                                   "shared_buffers")}
    finally:
        engine.dispose()
    return ", ".join(f"{k}={v}" for k, v in values.items())


def mysql_settings(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT @@version, @@innodb_flush_log_at_trx_commit, "
                                    "@@sync_binlog, @@innodb_buffer_pool_size")).one()
    finally:
        engine.dispose()
    return (f"{row[0]}, innodb_flush_log_at_trx_commit={row[1]}, sync_binlog={row[2]}, "
            f"innodb_buffer_pool_size={row[3]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="checkpoint save latency p50/p99")
    parser.add_argument("--rows", default="1000,1000000",
                        help="comma-separated numbers of rows already stored")
    parser.add_argument("--samples", type=int, default=3000, help="timed saves per case")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--first-saves", type=int, default=300,
                        help="timed first saves (checkpoint row inserted) per case")
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--mysql-url", default="mysql+pymysql://root@127.0.0.1:3306/test")
    parser.add_argument("--stores", default="postgresql,sqlite")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.rows.split(",") if x.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="bench-latency-"))
    print(f"machine: {machine()}")
    print(f"SQLAlchemy {sqlalchemy.__version__}; PostgreSQL {pg_settings(args.pg_url)}; "
          f"SQLite {sqlite3.sqlite_version} (WAL, synchronous=NORMAL)")
    if "mysql" in args.stores:
        print(f"MySQL/MariaDB {mysql_settings(args.mysql_url)}")
    print(f"{args.samples} timed saves per case after {args.warmup} warm-up saves; "
          f"{args.first_saves} first saves\n", flush=True)
    table = []
    for backend in (s.strip() for s in args.stores.split(",")):
        for rows in sizes:
            url = (args.pg_url if backend == "postgresql" else args.mysql_url
                   if backend == "mysql" else f"sqlite:///{tmp / f'latency-{rows}.sqlite3'}")
            table.append(measure(url, rows, args.samples, args.warmup, args.first_saves))
            print(f"done: {backend} with {rows:,} rows", file=sys.stderr, flush=True)
            if backend == "sqlite":
                for f in tmp.glob(f"latency-{rows}.sqlite3*"):
                    f.unlink()
    print(markdown_table(
        ["store", "rows already stored", "checkpoint rows", "fill s", "save p50 ms",
         "save p99 ms", "save mean ms", "first save p50 ms", "first save p99 ms"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
