"""Beat catch-up benchmark: real Redis (broker + RedBeat) and a real store.

1. Catch-up vs plain Celery, in the same run and alternating (``--reps`` repetitions, the
   order of the modes rotating each repetition; medians and the ratio of medians):

   - ``plain``: a plain Celery app (no celery-resilient) publishes ``--slots`` messages with
     ``app.send_task`` on one producer (one broker connection), as Celery's own beat would;
   - ``postgresql`` / ``sqlite``: the first tick of a ``ResilientScheduler`` whose entry's
     marker is ``--slots`` slots old, policy ``all``: every slot claimed in the store,
     published to the broker (one producer) and recorded sent. The store's schema check (done
     once at beat start) is outside the measurement; the tick's reconcile is inside.

   Target: catch-up / plain <= 1.2 on PostgreSQL.
2. Start with 1,000 entries (target <= 1 s): scheduler construction (RedBeat installs the
   static entries) plus the first tick (reconcile: a marker per entry, Redis meta and scores).

Usage: python benchmarks/beat_catchup.py [--store URL] [--sqlite URL|none] [--redis URL]
[--slots N] [--reps N] [--profile FILE]
(defaults: PostgreSQL 127.0.0.1/test, a temporary SQLite file, Redis 127.0.0.1:6379/9).
Recovery log lines are written at INFO to a temporary file, as a real beat would.
``--profile FILE`` adds one PostgreSQL catch-up under cProfile (not counted) and writes its
stats to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import os
import pstats
import statistics
import tempfile
import time
import uuid
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import redis
from celery import Celery
from redbeat.schedulers import acquire_distributed_beat_lock
from sqlalchemy import create_engine, inspect, text

from celery_resilient import Resilient
from celery_resilient.beat import ResilientScheduler
from celery_resilient.beat.windows import to_seconds, to_us
from celery_resilient.store.schedule import ScheduleStore
from celery_resilient.store.sql import Store

PG = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def make_app(broker: str, store_url: str, tables: str, prefix: str, queue: str,
             schedule: dict[str, Any]) -> Celery:
    app = Celery(f"bench-{prefix}", broker=broker, set_as_current=True)
    app.conf.update(
        resilient_store_url=store_url, resilient_table_prefix=tables,
        resilient_catchup_max_slots=20_000, task_default_queue=queue, timezone="UTC",
        redbeat_redis_url=broker, redbeat_key_prefix=prefix, beat_max_loop_interval=5,
        beat_schedule=schedule,
    )
    Resilient(app)
    return app


def start(app: Celery) -> ResilientScheduler:
    scheduler = ResilientScheduler(app)
    acquire_distributed_beat_lock(sender=SimpleNamespace(scheduler=scheduler))
    return scheduler


def plain_publish(broker: str, count: int) -> float:
    """Celery's own cost of publishing ``count`` task messages: the floor of any catch-up."""
    app = Celery(f"bench-plain-{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    with app.producer_or_acquire() as producer:
        began = time.perf_counter()
        for _ in range(count):
            app.send_task("bench.noop", (), {}, producer=producer, queue=queue,
                          task_id=str(uuid.uuid4()), headers={"celery_beat_task": True})
        elapsed = time.perf_counter() - began
    client = redis.Redis.from_url(broker)
    queued = client.llen(queue)
    client.delete(queue)
    client.close()
    app.close()
    assert queued == count, (queued, count)
    return elapsed


def catchup(broker: str, store_url: str, slots: int,
            profile: cProfile.Profile | None = None) -> float:
    tables, prefix, queue = f"b{uuid.uuid4().hex[:8]}_", f"bench-{uuid.uuid4().hex[:6]}:", \
        f"bench-{uuid.uuid4().hex[:6]}"
    schedule = {"every-second": {"task": "bench.noop", "schedule": timedelta(seconds=1)}}
    app = make_app(broker, store_url, tables, prefix, queue, schedule)
    store = Store(store_url, tables)
    store.migrate()
    _ = Resilient.of(app).store  # schema check outside the measurement, as at beat start
    now = to_us(app.now())
    # The entry's last slot was `slots` seconds ago (plus half a second of the current one).
    ScheduleStore(store).ensure_markers([(prefix + "every-second",
                                          to_seconds(now - slots * 1_000_000 - 500_000), None)])
    scheduler = start(app)
    if profile is not None:
        profile.enable()
    began = time.perf_counter()
    scheduler.tick()
    elapsed = time.perf_counter() - began
    if profile is not None:
        profile.disable()
    runs = ScheduleStore(store).runs_of(prefix + "every-second")
    sent = sum(1 for r in runs if r.state == "sent")
    queued = redis.Redis.from_url(broker).llen(queue)
    assert sent >= slots and queued >= slots and sent == queued == len(runs), \
        (sent, queued, len(runs))
    scheduler.close()
    Resilient.of(app).store.dispose()
    cleanup(broker, store_url, store, tables, prefix, queue)
    app.close()
    return elapsed


def startup(broker: str, store_url: str, entries: int) -> float:
    tables, prefix, queue = f"b{uuid.uuid4().hex[:8]}_", f"bench-{uuid.uuid4().hex[:6]}:", \
        f"bench-{uuid.uuid4().hex[:6]}"
    schedule = {f"entry-{i}": {"task": "bench.noop", "schedule": timedelta(minutes=5 + i % 50)}
                for i in range(entries)}
    app = make_app(broker, store_url, tables, prefix, queue, schedule)
    store = Store(store_url, tables)
    store.migrate()
    _ = Resilient.of(app).store  # schema check outside the measurement, as at worker start
    began = time.perf_counter()
    scheduler = start(app)
    scheduler.tick()
    elapsed = time.perf_counter() - began
    markers = ScheduleStore(store).markers(prefix)
    assert len(markers) >= entries, len(markers)
    print(f"start: {entries} entries installed, reconciled and their first tick done in "
          f"{elapsed:.2f} s; target <= 1 s")
    scheduler.close()
    cleanup(broker, store_url, store, tables, prefix, queue)
    return elapsed


def cleanup(broker: str, store_url: str, store: Store, tables: str, prefix: str,
            queue: str) -> None:
    client = redis.Redis.from_url(broker)
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    client.delete(queue, *keys)
    client.close()
    store.dispose()
    engine = create_engine(store_url)
    with engine.begin() as conn:
        for name in inspect(conn).get_table_names():
            if name.startswith(tables):
                drop = f'DROP TABLE IF EXISTS "{name}"'
                conn.execute(text(drop if engine.dialect.name == "sqlite" else drop + " CASCADE"))
    engine.dispose()


def compare(broker: str, stores: dict[str, str], slots: int, reps: int) -> None:
    """Plain send_task and each store's catch-up, alternating; medians and ratios."""
    modes = ["plain", *stores]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(reps):
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            took = (plain_publish(broker, slots) if mode == "plain"
                    else catchup(broker, stores[mode], slots))
            times[mode].append(took)
        cells = ", ".join(f"{m} {times[m][-1]:.2f} s" for m in modes)
        print(f"rep {rep + 1}/{reps} (order {' > '.join(order)}): {cells}", flush=True)
    plain = statistics.median(times["plain"])
    print(f"baseline: plain Celery send_task of {slots} messages: {plain:.2f} s (median of "
          f"{reps}; {min(times['plain']):.2f}-{max(times['plain']):.2f} s), one producer")
    for mode in stores:
        ours = statistics.median(times[mode])
        per_rep = statistics.median(o / p for o, p in zip(times[mode], times["plain"],
                                                          strict=True))
        print(f"catch-up: {slots} missed slots claimed, published and recorded sent ({mode} "
              f"store) in {ours:.2f} s (median of {reps}; {min(times[mode]):.2f}-"
              f"{max(times[mode]):.2f} s; {slots / ours:,.0f} slots/s)")
        print(f"catch-up ({mode}) / plain send_task = {ours / plain:.2f}x (ratio of medians; "
              f"median of per-repetition ratios {per_rep:.2f}x); target <= 1.2x on PostgreSQL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=PG, help="PostgreSQL store URL")
    parser.add_argument("--sqlite", default="",
                        help="SQLite store URL for the second row (default: a temporary "
                             "file; 'none' to skip)")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--slots", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--entries", type=int, default=1_000)
    parser.add_argument("--profile", default="", help="write cProfile stats of one "
                        "PostgreSQL catch-up to this file")
    args = parser.parse_args()
    log_path = tempfile.mkstemp(prefix="beat-bench-", suffix=".log")[1]
    logging.basicConfig(filename=log_path, level=logging.INFO)
    workdir = tempfile.mkdtemp(prefix="beat-bench-")
    stores = {"postgresql": args.store}
    if args.sqlite.lower() != "none":
        stores["sqlite"] = args.sqlite or f"sqlite:///{os.path.join(workdir, 'store.sqlite3')}"
    print(f"stores {', '.join(u.split('@')[-1] for u in stores.values())}, redis "
          f"{args.redis}; {args.slots} slots, {args.reps} reps; log {log_path}", flush=True)
    compare(args.redis, stores, args.slots, args.reps)
    if args.profile:
        prof = cProfile.Profile()
        catchup(args.redis, args.store, args.slots, prof)
        prof.dump_stats(args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    startup(args.redis, args.store, args.entries)


if __name__ == "__main__":
    main()
