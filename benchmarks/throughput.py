"""Throughput of trivial tasks: ResumableTask vs a plain ``acks_late=True`` task, in one run.

Real ``celery worker -c 2`` (prefork) processes on a Redis broker: one plain Celery worker (no
celery-resilient at all) and one ResumableTask worker per store (SQLite file, PostgreSQL). Only
one is loaded at a time. Every repetition measures every mode, in a rotating order, so drift on
the machine hits all modes alike. A measurement first publishes ``--tasks`` messages to a queue
nobody consumes (so the publisher does not compete for the 2 CPUs), then starts the clock and
tells the mode's worker to consume that queue (remote control ``add_consumer``), and stops the
clock when the queue is empty and nothing is left unacked (acks_late: a message is acked after
its task returned; for ResumableTask after the result is committed to the store).

    python benchmarks/throughput.py [--tasks 2000] [--reps 5] [--durable-submit]
                                    [--results stored] [--shape stream --rate 300]
                                    [--profile DIR [--cprofile]]

``--results stored``: every task stores its result in a Redis result backend and the caller
reads every one (the clock stops when all are read), as most Celery apps do; the default sends
``ignore_result`` tasks. ``--shape stream``: instead of a backlog published before the clock
starts, a producer sends at ``--rate`` tasks/s while the worker consumes, so deliveries arrive
a few at a time. Below a mode's capacity every mode keeps up with the rate, and the figure that
shows the price is the CPU per task (its ratio is the capacity each mode would have on a CPU-
bound machine); above it the queue builds up into a backlog again.

``--checkpoints N``: N progress points per task, a checkpoint save each for ResumableTask and,
for plain Celery, what a user would hand-write instead: an autocommitted upsert of a progress
row in the same PostgreSQL.

Prints a markdown table: median tasks/s per mode and the ratio ours/plain.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import sqlite3
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import celery
import kombu
import psycopg
import redis
import sqlalchemy
from bench_common import (
    Worker,
    machine,
    machine_busy_cpu,
    markdown_table,
    median,
    process_cpu,
    wait_for,
)
from celery import Celery
from celery.result import AsyncResult, ResultSet
from sqlalchemy import create_engine, text

from celery_resilient import Resilient, ResumableTask
from celery_resilient.store.sql import Store
from celery_resilient.testing.services import (
    ThrowawayPostgres,
    ThrowawayRedis,
    drop_prefixed_tables,
)

PLAIN, RESUMABLE = "bench.plain", "bench.resumable"


@dataclass
class Mode:
    name: str
    task: str
    store_url: str | None = None
    prefix: str = ""
    queue: str = ""
    #: "0": kombu's own Redis fetch instead of the reliable fetch (resumable modes)
    reliable_fetch: str = "1"
    #: Published through a Resilient client app with resilient_durable_submit (the store
    #: records each submission before the broker has it)
    durable: bool = False
    #: "0": resilient_batched_takes off (each pool process takes its own claims)
    batched: str = "1"
    worker: Worker | None = None
    rates: list[float] = field(default_factory=list)
    publish_rates: list[float] = field(default_factory=list)
    # CPU ms per task while the tasks ran: worker main process, pool processes, then the rest
    # of the machine, or with --own-servers: the PostgreSQL server, the Redis server, the caller
    cpu: list[tuple[float, ...]] = field(default_factory=list)

    @property
    def store_label(self) -> str:
        if self.store_url is None:
            return "none (plain Celery)"
        label = ("SQLite file" if self.store_url.startswith("sqlite") else
                 "MySQL/MariaDB" if self.store_url.startswith("mysql") else "PostgreSQL")
        if self.batched == "0":
            label += ", batched takes off"
        return (label + ("" if self.reliable_fetch == "1" else ", kombu's fetch")
                + (", durable submit" if self.durable else ""))


class Bench:
    def __init__(self, broker: str, concurrency: int, tmp: Path,
                 profile_dir: Path | None, body_ms: float = 0.0, prefetch: int = 4,
                 backend: str | None = None, stream_rate: float | None = None,
                 checkpoints: int = 0, pg_url: str = "") -> None:
        self.backend = backend
        self.checkpoints = checkpoints
        self.progress_table = f"bench_progress_{uuid.uuid4().hex[:8]}"
        self.progress_dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
        if checkpoints:
            with psycopg.connect(self.progress_dsn, autocommit=True) as conn:
                conn.execute(f"CREATE TABLE {self.progress_table} (task text PRIMARY KEY, "
                             "state text)")
        self.stream_rate = stream_rate
        self.body_ms = body_ms
        self.prefetch = prefetch
        self.broker = broker
        self.concurrency = concurrency
        self.tmp = tmp
        self.profile_dir = profile_dir
        self.cprofile = False
        self.redis = redis.Redis.from_url(broker)
        self.client = Celery("bench-client", broker=broker, backend=backend)
        self.unacked_baseline = int(self.redis.hlen("unacked"))
        self._durable: dict[str, Celery] = {}
        #: With --own-servers: the servers whose processes' CPU is counted, one column each.
        self.servers: OwnServers | None = None

    def start(self, mode: Mode) -> None:
        env = {"BENCH_BROKER": self.broker, "BENCH_QUEUE": mode.queue,
               "BENCH_RESILIENT": "1" if mode.store_url else "0",
               "BENCH_BODY_MS": str(self.body_ms), "BENCH_RELIABLE_FETCH": mode.reliable_fetch,
               "BENCH_PREFETCH": str(self.prefetch), "BENCH_BACKEND": self.backend or "",
               "BENCH_BATCHED_TAKES": mode.batched,
               "BENCH_CHECKPOINTS": str(self.checkpoints),
               "BENCH_PROGRESS_DSN": self.progress_dsn,
               "BENCH_PROGRESS_TABLE": self.progress_table}
        if mode.store_url:
            env |= {"BENCH_STORE_URL": mode.store_url, "BENCH_TABLE_PREFIX": mode.prefix}
            store = Store(mode.store_url, mode.prefix)
            store.migrate()
            store.dispose()
        if self.profile_dir:
            out = self.profile_dir / mode.name
            out.mkdir(parents=True, exist_ok=True)
            env["BENCH_PROFILE_DIR"] = str(out)
            env["BENCH_CPROFILE"] = "1" if self.cprofile else "0"
        # The worker starts on an idle queue of its own; run() points it at the loaded queue.
        mode.worker = Worker(mode.name, env, f"{mode.queue}-idle", self.tmp,
                             concurrency=self.concurrency).start()

    def server_cpu(self) -> tuple[float, ...]:
        """CPU seconds so far of the PostgreSQL server (every process of its cluster), the
        Redis server and this process (the caller: producer and result reader)."""
        if self.servers is None:
            return ()
        return (sum(process_cpu(pid) for pid in self.servers.pg_pids()),
                process_cpu(self.servers.redis_pid), own_cpu())

    def durable_client(self, mode: Mode) -> Celery:
        """A client app as a web process would have it: Resilient, the task known by
        class, durable submit on, the mode's store."""
        made = self._durable.get(mode.name)
        if made is None:
            made = Celery(f"bench-durable-{mode.name}", broker=self.broker)
            made.conf.update(resilient_store_url=mode.store_url,
                             resilient_table_prefix=mode.prefix,
                             resilient_durable_submit=True, task_ignore_result=True)
            Resilient(made)

            @made.task(name=RESUMABLE, base=ResumableTask, shared=False)
            def resumable(n: int) -> int:
                """Sent from here, run by the mode's worker."""
                return n

            self._durable[mode.name] = made
        return made

    def ping(self, mode: Mode) -> bool:
        if mode.worker is not None and not mode.worker.alive():
            raise RuntimeError(f"worker {mode.name} died:\n{mode.worker.logs()[-3000:]}")
        node = [f"{mode.name}@{socket.gethostname()}"]
        return bool(self.client.control.ping(destination=node, timeout=0.5))

    def drained(self, mode: Mode) -> bool:
        if mode.worker is not None and not mode.worker.alive():
            raise RuntimeError(f"worker {mode.name} died:\n{mode.worker.logs()[-3000:]}")
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(mode.queue)
        pipe.hlen("unacked")
        queued, unacked = pipe.execute()
        return int(queued) == 0 and int(unacked) <= self.unacked_baseline

    def run(self, mode: Mode, n: int, timeout: float = 300) -> tuple[float, float]:
        """Time the processing of ``n`` tasks; (tasks/s, publish msgs/s).

        Backlog shape: published first, then the clock starts as the worker is told to consume.
        Stream shape: the worker consumes first, and the clock runs from the first send."""
        client = self.durable_client(mode) if mode.durable else self.client
        pids = mode.worker.pids() if mode.worker is not None else []
        node = [f"{mode.name}@{socket.gethostname()}"]
        sent: list[AsyncResult] = []

        def publish(rate: float | None) -> None:
            with client.producer_or_acquire() as producer:
                start = time.perf_counter()
                for i in range(n):
                    if rate is not None:  # pace the producer: the i-th send is due at i/rate
                        ahead = start + i / rate - time.perf_counter()
                        if ahead > 0:
                            time.sleep(ahead)
                    sent.append(client.send_task(mode.task, args=(i,), queue=mode.queue,
                                                 producer=producer))

        def consume() -> None:
            replies = self.client.control.add_consumer(mode.queue, destination=node,
                                                       reply=True, timeout=10)
            if not replies:
                raise RuntimeError(f"worker {mode.name} did not answer add_consumer")
            # kombu's blocking pop on the idle queue takes the new queue in only when it
            # returns (its brpop_timeout, 1 s; the library's fetch waits 0.1 s): without a
            # task on the idle queue to end it now, plain Celery's clock would carry up to a
            # second more.
            self.client.send_task(mode.task, args=(-1,), queue=f"{mode.queue}-idle")

        if self.stream_rate is None:
            t_publish = time.perf_counter()
            publish(None)
            t0 = time.perf_counter()
            publish_rate = n / (t0 - t_publish)
            cpu0 = [process_cpu(pid) for pid in pids]
            busy0, servers0 = machine_busy_cpu(), self.server_cpu()
            consume()
        else:
            consume()
            wait_for(lambda: self.drained(mode), timeout, f"{mode.name} to take the kick")
            cpu0 = [process_cpu(pid) for pid in pids]
            busy0, servers0 = machine_busy_cpu(), self.server_cpu()
            t0 = time.perf_counter()
            publish(self.stream_rate)
            publish_rate = n / (time.perf_counter() - t0)
        wait_for(lambda: self.drained(mode), timeout, f"{mode.name} to drain {n} tasks")
        if self.backend:
            ResultSet(sent, app=self.client).get(timeout=timeout)  # the caller reads them all
        elapsed = time.perf_counter() - t0
        used = [process_cpu(pid) - before for pid, before in zip(pids, cpu0, strict=True)]
        rest = machine_busy_cpu() - busy0 - sum(used)
        main_and_pool = (used[0] * 1000 / n if used else 0.0, sum(used[1:]) * 1000 / n)
        if self.servers is None:
            mode.cpu.append((*main_and_pool, rest * 1000 / n))
        else:
            servers = self.server_cpu()
            mode.cpu.append((*main_and_pool, *((after - before) * 1000 / n for after, before
                                               in zip(servers, servers0, strict=True))))
        self.client.control.cancel_consumer(mode.queue, destination=node, reply=True,
                                            timeout=10)
        if self.backend:
            for result in sent:
                result.forget()
        return n / elapsed, publish_rate

def own_cpu() -> float:
    """CPU seconds this process (and its threads) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class OwnServers:
    """A PostgreSQL cluster and a Redis server of the benchmark's own: nothing else uses them,
    so their processes' CPU is each mode's price on the server side. The cluster runs with
    autovacuum on (as production does; the machine's shared server may not) and
    ``pg_stat_statements`` (planning tracked), for the statements each mode makes."""

    def __init__(self) -> None:
        self.pg = ThrowawayPostgres(settings=["shared_preload_libraries=pg_stat_statements",
                                              "pg_stat_statements.track_planning=on"]).init()
        self.redis = ThrowawayRedis()
        try:
            self.pg.start()
            self.redis.start()
            self._admin = create_engine(self.pg.url, isolation_level="AUTOCOMMIT")
            with self._admin.connect() as conn:
                conn.execute(text("CREATE EXTENSION pg_stat_statements"))
        except BaseException:
            self.destroy()
            raise

    @property
    def redis_pid(self) -> int:
        assert self.redis.proc is not None
        return self.redis.proc.pid

    def pg_pids(self) -> list[int]:
        """The postmaster and its children (backends, WAL writer, checkpointer, autovacuum)."""
        postmaster = self.pg.postmaster_pid()
        pids = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while we looked
            if ppid == postmaster:
                pids.append(int(stat.parent.name))
        return pids

    def reset_statements(self) -> None:
        with self._admin.connect() as conn:
            conn.execute(text("SELECT pg_stat_statements_reset()"))

    def statements(self, tasks: int) -> str:
        """The statements made since the last reset, per task: calls, server time (planning
        and execution), WAL bytes; the benchmark's own queries left out."""
        with self._admin.connect() as conn:
            rows = conn.execute(text(
                "SELECT query, calls, total_plan_time, total_exec_time, wal_bytes "
                "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                "WHERE datname = current_database()) AND query NOT LIKE '%pg_stat_statements%' "
                "ORDER BY total_plan_time + total_exec_time DESC")).all()
        total = sum(r.total_plan_time + r.total_exec_time for r in rows)
        shown = [r for r in rows if r.calls >= tasks / 100]
        table = markdown_table(
            ["statement", "calls per task", "mean plan ms", "mean exec ms",
             "server ms per task", "WAL bytes per task"],
            [(f"`{' '.join(r.query.split())[:90]}`", f"{r.calls / tasks:.2f}",
              f"{r.total_plan_time / r.calls:.3f}", f"{r.total_exec_time / r.calls:.3f}",
              f"{(r.total_plan_time + r.total_exec_time) / tasks:.3f}",
              f"{int(r.wal_bytes) / tasks:.0f}") for r in shown])
        return (f"\n### PostgreSQL statements of the timed reps, every PostgreSQL mode "
                f"(pg_stat_statements), {tasks} tasks: {total / tasks:.3f} server ms per task "
                f"in all\n\n{table}")

    def destroy(self) -> None:
        admin = getattr(self, "_admin", None)
        if admin is not None:
            admin.dispose()
        self.redis.destroy()
        self.pg.destroy()


def profile_summary(profile_dir: Path, modes: list[Mode], tasks_per_mode: int) -> str:
    out: list[str] = []
    for mode in modes:
        files = sorted((profile_dir / mode.name).glob("*.json"))
        if not files or mode.store_url is None:
            continue
        calls: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
        sql: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
        for f in files:
            data = json.loads(f.read_text())
            for name, (count, total) in data["calls"].items():
                calls[(data["role"], name)][0] += count
                calls[(data["role"], name)][1] += total
            for stmt, (count, total) in data["sql"].items():
                sql[(data["role"], stmt)][0] += count
                sql[(data["role"], stmt)][1] += total
        out.append(f"\n### Store calls, {mode.name} ({tasks_per_mode} tasks)\n")
        out.append(markdown_table(
            ["process", "call", "calls", "per task", "mean ms", "total s"],
            [(role, name, int(c), f"{c / tasks_per_mode:.2f}", f"{t / c * 1000:.3f}",
              f"{t:.2f}")
             for (role, name), (c, t) in sorted(calls.items(), key=lambda kv: -kv[1][1]) if c]))
        out.append(f"\n### SQL statements, {mode.name}\n")
        out.append(markdown_table(
            ["process", "statement", "count", "per task", "mean ms", "total s"],
            [(role, f"`{stmt}`", int(c), f"{c / tasks_per_mode:.2f}",
              f"{t / c * 1000:.3f}" if t else "-", f"{t:.2f}" if t else "-")
             for (role, stmt), (c, t) in sorted(sql.items(), key=lambda kv: -kv[1][0])[:14]
             if c]))
    return "\n".join(out)


def versions(pg_url: str, r: redis.Redis) -> str:
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            pg = str(conn.execute(text("SHOW server_version")).scalar_one()).split()[0]
    finally:
        engine.dispose()
    redis_version = r.info("server").get("redis_version", "?")
    return (f"celery {celery.__version__}, kombu {kombu.__version__}, SQLAlchemy "
            f"{sqlalchemy.__version__}, PostgreSQL {pg}, SQLite {sqlite3.sqlite_version}, "
            f"Redis {redis_version}")


def results_table(modes: list[Mode], own_servers: bool) -> str:
    plain = modes[0]
    cpu_columns = ["worker main", "pool processes",
                   *(("PostgreSQL server", "Redis server", "caller") if own_servers
                     else ("rest of machine",))]

    def cpu_total(mode: Mode) -> float:
        return median([sum(c) for c in mode.cpu[-len(mode.rates):]])

    rows = []
    for mode in modes:
        paired = [r / p for r, p in zip(mode.rates, plain.rates, strict=True)]
        # wall time each task adds at this concurrency, from the per-rep pairs
        added = [1000 / r - 1000 / p for r, p in zip(mode.rates, plain.rates, strict=True)]
        rows.append((
            mode.name, mode.store_label, f"{median(mode.rates):.0f}",
            f"{min(mode.rates):.0f}-{max(mode.rates):.0f}",
            f"{median(mode.rates) / median(plain.rates):.2f}",
            f"{median(paired):.2f}", f"{median(added):+.3f}", f"{median(mode.publish_rates):.0f}",
            *(f"{median([c[i] for c in mode.cpu[-len(mode.rates):]]):.2f}"
              for i in range(len(cpu_columns))),
            f"{cpu_total(plain) / cpu_total(mode):.2f}",
        ))
    return markdown_table(
        ["mode", "store", "median tasks/s", "range", "ratio ours/plain (medians)",
         "ratio (median of per-rep pairs)", "added ms per task (wall, per-rep pairs)",
         "publish msgs/s",
         "CPU ms/task: worker main", "pool processes", *cpu_columns[2:],
         "CPU ratio plain/ours (all CPU per task)"], rows)


def measure(bench: Bench, modes: list[Mode], args: argparse.Namespace) -> None:
    for mode in modes:
        bench.start(mode)
    for mode in modes:
        wait_for(lambda m=mode: bench.ping(m), 60, f"worker {mode.name} to answer")
        bench.run(mode, args.warmup, timeout=120)
    if bench.servers is not None:
        bench.servers.reset_statements()
    for rep in range(args.reps):
        order = modes[rep % len(modes):] + modes[:rep % len(modes)]
        for mode in order:
            rate, publish_rate = bench.run(mode, args.tasks)
            mode.rates.append(rate)
            mode.publish_rates.append(publish_rate)
        print(f"rep {rep + 1}: " + ", ".join(f"{m.name} {m.rates[-1]:.0f}/s" for m in modes),
              flush=True)
    for mode in modes:
        if mode.store_url:
            store = Store(mode.store_url, mode.prefix)
            done = store.count_by_state().get("done", 0)
            store.dispose()
            expected = args.warmup + args.reps * args.tasks + 1 + args.reps  # + the kicks
            if done != expected:
                raise RuntimeError(f"{mode.name}: {done} works done, expected {expected}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="ResumableTask vs plain acks_late throughput")
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per measurement")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every mode")
    parser.add_argument("--warmup", type=int, default=300, help="tasks per mode before timing")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=4,
                        help="worker_prefetch_multiplier of every mode's worker")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    parser.add_argument("--mysql-url", default="mysql+pymysql://root@127.0.0.1:3306/test")
    parser.add_argument("--stores", default="sqlite,postgresql",
                        help="comma-separated: sqlite, postgresql, mysql, mysql-unbatched "
                             "(resilient_batched_takes off)")
    parser.add_argument("--compare-fetch", action="store_true",
                        help="also run each resumable mode with kombu's own Redis fetch "
                             "(resilient_reliable_fetch=False), in the same rotation")
    parser.add_argument("--durable-submit", action="store_true",
                        help="also run each resumable mode published with "
                             "resilient_durable_submit (a Resilient client app), in the rotation")
    parser.add_argument("--body-ms", type=float, default=0.0,
                        help="milliseconds each task body sleeps (0: trivial tasks)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="directory: time every store call and SQL statement in the workers "
                             "(its statement listeners send the hot statements through "
                             "SQLAlchemy's execution layer, ~0.06 ms slower each)")
    parser.add_argument("--cprofile", action="store_true",
                        help="with --profile: also a CPU-time cProfile of every worker process "
                             "(<DIR>/<mode>/<role>-<pid>.prof; read with python -m pstats)")
    parser.add_argument("--results", choices=("ignored", "stored"), default="ignored",
                        help="stored: a Redis result backend (--backend), the caller reads "
                             "every result before the clock stops")
    parser.add_argument("--backend", default=None,
                        help="result backend URL for --results stored (default: the broker's "
                             "Redis, next database)")
    parser.add_argument("--checkpoints", type=int, default=0,
                        help="progress points per task: ResumableTask saves a checkpoint at "
                             "each, plain Celery upserts a progress row in --pg-url")
    parser.add_argument("--shape", choices=("backlog", "stream"), default="backlog",
                        help="backlog: published before the clock starts; stream: sent at "
                             "--rate while the worker consumes")
    parser.add_argument("--rate", type=float, default=300.0,
                        help="tasks/s the producer sends in the stream shape")
    parser.add_argument("--own-servers", action="store_true",
                        help="run on a PostgreSQL cluster and a Redis server of the benchmark's "
                             "own (autovacuum on), and print their CPU per task and the "
                             "statements each task costs the server (pg_stat_statements) "
                             "instead of the rest of the machine's CPU")
    args = parser.parse_args(argv)
    if args.results == "stored" and args.backend is None:
        base, _, db = args.broker.rpartition("/")
        args.backend = f"{base}/{(int(db or 0) + 1) % 16}"
    if args.cprofile and not args.profile:
        parser.error("--cprofile needs --profile DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    servers = OwnServers() if args.own_servers else None
    if servers is not None:
        args.broker = servers.redis.url.rsplit("/", 1)[0] + "/13"
        args.pg_url = servers.pg.url
        if args.results == "stored":
            args.backend = servers.redis.url.rsplit("/", 1)[0] + "/14"
    try:
        return run_modes(args, servers)
    finally:
        if servers is not None:
            servers.destroy()


def run_modes(args: argparse.Namespace, servers: OwnServers | None) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    tag = uuid.uuid4().hex[:8]
    modes = [Mode("plain", PLAIN)]
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    if "sqlite" in stores:
        modes.append(Mode("resumable-sqlite", RESUMABLE, f"sqlite:///{tmp / 'store.sqlite3'}",
                          "resilient_"))
    if "postgresql" in stores:
        modes.append(Mode("resumable-postgresql", RESUMABLE, args.pg_url, f"bench{tag}_"))
    if "mysql" in stores:
        modes.append(Mode("resumable-mysql", RESUMABLE, args.mysql_url, f"bench{tag}_"))
    if "mysql-unbatched" in stores:
        modes.append(Mode("resumable-mysql-unbatched", RESUMABLE, args.mysql_url,
                          f"bench{tag}u_", batched="0"))
    if args.compare_fetch:
        modes += [Mode(f"{m.name}-kombu-fetch", m.task, m.store_url,
                       m.prefix if m.store_url and m.store_url.startswith("sqlite")
                       else f"{m.prefix}k", reliable_fetch="0")
                  for m in modes if m.store_url]
        for m in modes:  # SQLite modes need stores of their own
            if m.reliable_fetch == "0" and m.store_url and m.store_url.startswith("sqlite"):
                m.store_url = f"sqlite:///{tmp / 'store-kombu-fetch.sqlite3'}"
    if args.durable_submit:
        modes += [Mode(f"{m.name}-durable", m.task, m.store_url,
                       f"{m.prefix}d" if not m.store_url.startswith("sqlite") else m.prefix,
                       durable=True)
                  for m in modes if m.store_url and m.reliable_fetch == "1"]
        for m in modes:  # SQLite modes need stores of their own
            if m.durable and m.store_url and m.store_url.startswith("sqlite"):
                m.store_url = f"sqlite:///{tmp / 'store-durable.sqlite3'}"
    for mode in modes:
        mode.queue = f"bench-{mode.name}-{tag}"

    bench = Bench(args.broker, args.concurrency, tmp, args.profile, args.body_ms,
                  args.prefetch, backend=args.backend if args.results == "stored" else None,
                  stream_rate=args.rate if args.shape == "stream" else None,
                  checkpoints=args.checkpoints, pg_url=args.pg_url)
    bench.cprofile = args.cprofile
    bench.servers = servers
    if bench.unacked_baseline:
        print(f"note: {bench.unacked_baseline} unacked messages already in {args.broker}; "
              "use a broker database of its own for exact drain detection", file=sys.stderr)
    print(f"machine: {machine()}; load average at start "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"versions: {versions(args.pg_url, bench.redis)}")
    print(f"broker {args.broker}; celery worker -c {args.concurrency} prefork, "
          f"prefetch x{args.prefetch}; "
          f"{args.tasks} tasks x {args.reps} reps per mode, {args.warmup} warm-up tasks, "
          f"task body {args.body_ms} ms; results {args.results}"
          + (f"; {args.checkpoints} progress points per task (checkpoint saves; plain "
             f"Celery: hand-written upserts in PostgreSQL)" if args.checkpoints else "")
          + (f" in {args.backend}" if args.results == "stored" else "")
          + (f"; stream at {args.rate:.0f} tasks/s" if args.shape == "stream"
             else "; backlog published before the clock") + "\n",
          flush=True)
    try:
        measure(bench, modes, args)
    finally:
        for mode in modes:
            if mode.worker is not None:
                mode.worker.stop()
        for mode in modes:
            if mode.store_url and not mode.store_url.startswith("sqlite"):
                drop_prefixed_tables(mode.store_url, mode.prefix)
        for key in bench.redis.scan_iter(f"*{tag}*"):  # our queues and kombu's bindings
            bench.redis.delete(key)

    print("load average at end " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print()
    print(results_table(modes, servers is not None))
    if servers is not None:
        print(servers.statements(args.reps * args.tasks))
    if args.profile:
        print(profile_summary(args.profile, modes, args.warmup + args.reps * args.tasks))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
