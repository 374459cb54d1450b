"""Beat catch-up benchmark: real Redis (broker + RedBeat) and a real store.

1. Reconcile and enqueue 10,000 missed slots of one entry (target <= 5 s): the first tick of
   a beat whose entry's marker is 10,000 slots old, policy ``all``, every slot claimed in the
   store, published to the broker and recorded sent.
2. Start with 1,000 entries (target <= 1 s): scheduler construction (RedBeat installs the
   static entries) plus the first tick (reconcile: a marker per entry, Redis meta and scores).

Usage: python benchmarks/beat_catchup.py [--store URL] [--redis URL]
(defaults: PostgreSQL 127.0.0.1/test and Redis 127.0.0.1:6379/9). Recovery log lines are
written at INFO to a temporary file, as a real beat would.
"""

from __future__ import annotations

import argparse
import logging
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
    app = Celery("bench-plain", broker=broker, set_as_current=False)
    queue = f"bench-{uuid.uuid4().hex[:6]}"
    with app.producer_or_acquire() as producer:
        began = time.perf_counter()
        for _ in range(count):
            app.send_task("bench.noop", (), {}, producer=producer, queue=queue,
                          task_id=str(uuid.uuid4()), headers={"celery_beat_task": True})
        elapsed = time.perf_counter() - began
    redis.Redis.from_url(broker).delete(queue)
    app.close()
    print(f"baseline: plain Celery send_task of {count} messages: {elapsed:.2f} s")
    return elapsed


def catchup(broker: str, store_url: str, slots: int) -> float:
    tables, prefix, queue = f"b{uuid.uuid4().hex[:8]}_", f"bench-{uuid.uuid4().hex[:6]}:", \
        f"bench-{uuid.uuid4().hex[:6]}"
    schedule = {"every-second": {"task": "bench.noop", "schedule": timedelta(seconds=1)}}
    app = make_app(broker, store_url, tables, prefix, queue, schedule)
    store = Store(store_url, tables)
    store.migrate()
    now = to_us(app.now())
    # The entry's last slot was `slots` seconds ago (plus half a second of the current one).
    ScheduleStore(store).ensure_markers([(prefix + "every-second",
                                          to_seconds(now - slots * 1_000_000 - 500_000), None)])
    scheduler = start(app)
    began = time.perf_counter()
    scheduler.tick()
    elapsed = time.perf_counter() - began
    runs = ScheduleStore(store).runs_of(prefix + "every-second")
    sent = sum(1 for r in runs if r.state == "sent")
    queued = redis.Redis.from_url(broker).llen(queue)
    assert sent >= slots and queued >= slots, (sent, queued)
    print(f"catch-up: {sent} missed slots claimed, published ({queued} messages on the "
          f"queue) and recorded sent in {elapsed:.2f} s ({sent / elapsed:,.0f} slots/s); "
          "target <= 5 s")
    scheduler.close()
    cleanup(broker, store_url, store, tables, prefix, queue)
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
    store.dispose()
    engine = create_engine(store_url)
    with engine.begin() as conn:
        for name in inspect(conn).get_table_names():
            if name.startswith(tables):
                conn.execute(text(f'DROP TABLE IF EXISTS "{name}" CASCADE'))
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--slots", type=int, default=10_000)
    parser.add_argument("--entries", type=int, default=1_000)
    args = parser.parse_args()
    log_path = tempfile.mkstemp(prefix="beat-bench-", suffix=".log")[1]
    logging.basicConfig(filename=log_path, level=logging.INFO)
    print(f"store {args.store.split('@')[-1]}, redis {args.redis}; log {log_path}")
    floor = plain_publish(args.redis, args.slots)
    took = catchup(args.redis, args.store, args.slots)
    print(f"catch-up / plain publish = {took / floor:.2f}x")
    startup(args.redis, args.store, args.entries)


if __name__ == "__main__":
    main()
