"""Chaos soak: real workers SIGKILLed and deployed at random while they work, the broker and
the store restarted and taken away for a while.

    python benchmarks/chaos.py --tasks 10000 --workers 4 --kills 100 --deploys 20 \
        --chaos-seconds 700 --seconds 1500                                         # full
    python benchmarks/chaos.py --tasks 300 --workers 3 --kills 10 --deploys 3 \
        --chaos-seconds 60 --seconds 240                                           # CI size
    ... --store mariadb                                     # the same on a MariaDB store

With the defaults a user has: Redis's own visibility timeout (an hour), no durable submit
(``--durable-submit`` and ``--visibility-timeout`` exist to compare). A submitted task that
never ends ``done`` (lost from the broker, or left in its ``unacked`` hash) is a violation.

Everything it touches is its own: a throwaway ``redis-server`` (append-only file, fsync always)
on a free port as the broker, a throwaway store server (``--store``: a PostgreSQL cluster,
``initdb``, or a MariaDB server, ``mariadb-install-db``; under /tmp, on a free port), worker
processes of ``tests/chaos/chaosproj.py`` in their own process groups. The
machine's own servers are never stopped.

Timeline: tasks (long checkpointing tasks, short tasks, step tasks, ``ledger.atomic`` tasks)
are submitted at a steady pace during the chaos phase; meanwhile, at random times:

- a random worker is SIGKILLed (its whole process group, then restarted at once or after a
  pause longer than the lease, so other workers take its claims over; or one pool child only);
- a random worker is deployed (``--deploys``): SIGTERM to its main process only, as a deploy
  or Kubernetes sends it; its running work hands off at its next checkpoint and it must exit
  (a deploy longer than 30 s is a violation), then it starts again;

and at fixed points Redis is SIGKILLed and restarted, Redis is down for
``--broker-outage-seconds`` (a broker outage), the store server is stopped at once
(PostgreSQL ``-m immediate``, MariaDB a SIGKILL) and started again (``--store-restarts``), and
it is down for the lease plus 3 s (a store outage longer than
the lease: every lease looks expired when it returns; two "quiet" tasks, sent just before it,
sleep through it in one row and must keep their claims, unless their own worker fences them
first: the outage is longer than the lease minus the fence margin). Two of the workers run
under one node name (``-n same@%h``, ``--same-name``) for the whole run; one runs in a network
namespace whose store link is cut without a reset for the lease plus 3 s (``--partitions``;
once the store answers and that worker runs, which kills and deploys then spare);
every other whole-worker SIGKILL is followed by a restart in a new PID namespace (``unshare``,
as a container restart). A worker that exits, or must start
again while the broker or the store is down, is (re)started as a supervisor would, once both
answer. Then every worker is up and the run drains. Bounded: ``--seconds`` is a hard deadline.

The invariants are checked from the store and from the effect log (one fsync'd line per effect
written by the process that did it); any violation exits 1, a deadline overrun exits 2:

1. every task is ``done``; no work row is reserved/running/requeued/failed/dead;
2. steps and ledger effects: once a step result or ledger marker is stored, no later execution
   runs the effect again (no effect line from an epoch after the stored one) and the stored
   result names an epoch whose effect was recorded; an effect line repeats only from an
   earlier, superseded epoch (the kill window between the effect and its marker), never twice
   from one epoch;
3. ``ledger.atomic`` writes to the store's database: exactly one row per work;
4. checkpoints never go backwards: per work, the sequence numbers of the saves are strictly
   increasing in log order, every (re)start resumes at or beyond the last logged save, and the
   final checkpoint is the last row;
5. rows (effects outside the store, made before each checkpoint): every row ran; no row ran
   twice in one execution; an execution that follows another resumed at that execution's
   last row (the row in flight at the kill, run again) or the one after it, never earlier;
6. nothing ran after the work was done: no effect line from an epoch above the final epoch,
   and the finishing execution of a long or short task recorded its effect;
7. no two executions of one unit overlap: per work, the lines of each fencing token (its
   ``start``, effects, checkpoints, ``end``) span an interval, and no two intervals of
   different tokens intersect. Only a write the store refused (``refused``: the fence at work)
   may come after the successor started; one token is one pid.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sqlalchemy import select  # noqa: E402

from celery_resilient.core import codec  # noqa: E402
from celery_resilient.errors import ResilientError  # noqa: E402
from celery_resilient.store.sql import Store  # noqa: E402
from celery_resilient.testing import EffectLog  # noqa: E402
from celery_resilient.testing.nodes import LocalWorker  # noqa: E402
from celery_resilient.testing.partitions import NetworkNamespace  # noqa: E402
from celery_resilient.testing.services import (  # noqa: E402
    STORE_SERVERS,
    ThrowawayRedis,
    throwaway_store,
)
from celery_resilient.testing.waiting import WaitTimeout  # noqa: E402
from celery_resilient.testing.waiting import wait_for as _wait_for  # noqa: E402
from tests.chaos import chaosproj  # noqa: E402

T = TypeVar("T")
APP = "tests.chaos.chaosproj"
PREFIX = "chaos_"
SAME_NAME = "same@%h"
# Seconds from SIGTERM to exit; longer is a violation (a hang). A deploy landing as the store
# goes down can take billiard's 30 s result drain (docs/reliability.md, "Open: a deploy..."):
# that is reported in deploy_exit_max_seconds, not hidden, and stays under this limit.
DEPLOY_LIMIT = 45.0
SETTLE = 3.0  # seconds a (re)started worker gets to take work before it is killed again
MIX = (("long", 0.2), ("short", 0.5), ("steps", 0.15), ("atomic", 0.15))
LEASE = 6  # a short lease, so a store outage longer than it fits in the soak
WORKER_SETTINGS = {
    "resilient_lease_seconds": LEASE, "resilient_heartbeat_interval": 1,
    "resilient_sweep_interval": 1, "resilient_max_attempts": 1000,
    "resilient_store_retry_base": 0.5, "resilient_store_retry_max": 2,
    "resilient_submit_timeout": 30,
}
STORE_OUTAGE = LEASE + 3  # seconds the store server stays down: every lease looks expired after it
PARTITION = LEASE + 3  # seconds one worker's store link stays cut
UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc")
#: "quiet" work (the long task, one row of QUIET_ROW seconds) is sent right before each store
#: outage: its row spans the whole outage without touching the store, so its claim, under a
#: lease that looks expired when the store returns, must survive the sweeps that follow.
QUIET_PER_OUTAGE = 2
QUIET_ROW = STORE_OUTAGE + 5
TASK_OF = {"quiet": "long"}


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_for(condition: Callable[[], T], timeout: float, what: str,
             interval: float = 0.1) -> T:
    """The library's wait; a deadline missed is a ``TimeoutError`` for the run's bookkeeping."""
    try:
        return _wait_for(condition, timeout, what, interval)
    except WaitTimeout as exc:
        raise TimeoutError(str(exc)) from None


def group_gone(worker: LocalWorker, timeout: float) -> None:
    """Wait until no process of the worker's group is left (its pool drained with it)."""
    pgid = worker.process.pid

    def gone() -> bool:
        try:
            os.killpg(pgid, 0) if pgid else None
        except ProcessLookupError:
            return True
        return pgid is None

    try:
        wait_for(gone, timeout, f"process group of {worker.worker_name} to exit")
    except TimeoutError:
        log(f"{worker.worker_name}: pool processes outlived the main process; SIGKILL them")
        if pgid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


def overlaps(key: str, entries: list[dict[str, Any]]) -> tuple[list[str], int]:
    """Invariant 7: no two executions of one unit overlap in time (and one token, one pid).

    Each fencing token's lines span [first ts, last ts]; a ``refused`` write (the store's fence
    turning a superseded execution away) is left out of its span: it is the one line allowed
    after the successor started. Everything else (``start``, an effect outside the store, a
    committed checkpoint, ``end``) means the execution was still running. Returns the
    violations and the number of refused writes.
    """
    bad: list[str] = []
    refused = 0
    spans: dict[int, tuple[float, float, dict[str, Any]]] = {}  # token -> first, last, line
    pids: dict[int, set[int]] = defaultdict(set)
    for e in entries:
        token = int(e["epoch"])
        pids[token].add(int(e["pid"]))
        if e["effect"] == "refused":
            refused += 1
            continue
        first, last, line = spans.get(token, (e["ts"], e["ts"], e))
        spans[token] = (min(first, e["ts"]), *((e["ts"], e) if e["ts"] >= last else (last, line)))
    for token, seen in sorted(pids.items()):
        if len(seen) > 1:
            bad.append(f"{key}: fencing token {token} ran in {len(seen)} processes "
                       f"{sorted(seen)}")
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for n, (later, (start, _, first_line)) in enumerate(ordered):
        for earlier, (_, end, line) in ordered[:n]:
            if start < end:
                bad.append(f"{key}: executions overlap: token {earlier} (pid {line['pid']}) "
                           f"wrote {line['effect']!r} at {end:.3f}, {end - start:.3f}s after "
                           f"token {later} (pid {first_line['pid']}) started at {start:.3f}")
    return bad, refused


ENDED = ("end", "handoff", "unavailable", "refused")  # lines after which an execution is over


def killed_mid_task(by_key: dict[str, list[dict[str, Any]]],
                    kills: list[tuple[float, set[int]]]) -> int:
    """How many SIGKILLs hit running work, from the effect log: an execution in a killed pid
    had started before the kill, had not ended, and never wrote again."""
    spans: list[tuple[int, float, float, bool]] = []  # pid, first, last, ended
    for entries in by_key.values():
        tokens: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in entries:
            tokens[int(e["epoch"])].append(e)
        for lines in tokens.values():
            spans.append((int(lines[0]["pid"]), lines[0]["ts"], lines[-1]["ts"],
                          any(e["effect"] in ENDED for e in lines)))
    return sum(1 for at, pids in kills
               if any(pid in pids and first < at and last < at and not ended
                      for pid, first, last, ended in spans))


def quiet_through(entries: list[dict[str, Any]], outages: list[list[float]]) -> int:
    """Executions that ran a row across a whole store outage and recorded it afterwards: alive
    all along, lease unrenewed, so the sweeps after the outage had to leave their claim be."""
    last: dict[int, float] = {}
    found: set[int] = set()
    for e in entries:
        token = int(e["epoch"])
        if e["effect"] == "row" and token in last and any(
                last[token] < down and e["ts"] > up for down, up in outages):
            found.add(token)
        last[token] = e["ts"]
    return len(found)


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Figures:
    tasks: int = 0
    workers: int = 0
    kills_group: int = 0
    kills_child: int = 0
    kills_mid_task: int = 0
    delayed_restarts: int = 0
    unplanned_exits: int = 0
    redis_restarts: int = 0
    store: str = ""
    store_restarts: int = 0
    container_restarts: int = 0
    partitions: int = 0
    partition_seconds: float = 0.0
    partition_claims: int = 0
    self_fenced: int = 0
    deploys: int = 0
    deploys_mid_task: int = 0
    deploy_exit_max_seconds: float = 0.0
    deploy_exit_seconds: list[float] = field(default_factory=list)
    handed_off: int = 0
    same_name_workers: int = 0
    same_name_warnings: int = 0
    store_outages: int = 0
    store_outage_seconds: float = 0.0
    broker_outages: int = 0
    broker_outage_seconds: float = 0.0
    overlaps: int = 0
    quiet_through_store_outage: int = 0
    fenced_writes: int = 0
    chaos_seconds: float = 0.0
    drain_seconds: float = 0.0
    total_seconds: float = 0.0
    deaths: int = 0
    republished: int = 0
    resumed_long: int = 0
    rows_repeated: int = 0
    short_repeated: int = 0
    step_effects_repeated: int = 0
    ledger_effects_repeated: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.dir = Path(tempfile.mkdtemp(prefix="chaos-run-", dir="/tmp"))
        self.effects = EffectLog(self.dir / "effects.jsonl")
        # One worker runs in a network namespace whose store link a partition fault cuts.
        self.ns = NetworkNamespace(2).create() if args.partitions else None
        inner = [self.ns.host_ip(0)] if self.ns else []
        self.redis = ThrowawayRedis(persistent=True,
                                    also_listen=[self.ns.host_ip(1)] if self.ns else [])
        self.server = throwaway_store(args.store, max_connections=200, also_listen=inner)
        self.queue = f"chaos-{uuid.uuid4().hex[:8]}"
        self.workers: list[LocalWorker] = []
        self.down_until: dict[int, float] = {}
        self.stopping: dict[int, float] = {}  # deploys under way: worker -> SIGTERM time
        self.exited_at: dict[int, float] = {}  # deploys: when the main process exited
        self.store_down_wall: list[list[float]] = []  # store outages, wall clock
        self.kill_log: list[tuple[float, set[int]]] = []  # SIGKILLs: wall clock, pids hit
        self.started_at: dict[int, float] = {}  # worker -> when it last came up
        self.quiet: dict[int, list[tuple[str, str, tuple[Any, ...]]]] = {}  # outage -> work
        self.held: set[str] = set()  # quiet work: sent by its outage, not by the submitter
        self.protected: tuple[set[int], float] = (set(), 0.0)  # pids kept alive, until
        self.outages: set[str] = set()  # "broker" and/or "store" while taken away
        self.events: list[tuple[float, int, str]] = []  # (seconds into the phase, n, what)
        self.counter = itertools.count()
        self.figures = Figures(tasks=args.tasks, workers=args.workers, store=args.store)
        self.plan: list[tuple[str, str, tuple[Any, ...]]] = []  # (task_id, kind, args)
        self.sent = 0
        self.send_error: BaseException | None = None
        self.store: Store | None = None
        self.partitioned: int | None = None  # the worker inside the network namespace
        self.group_restarts = 0
        self.cut = False  # the partitioned worker's store link is cut

    # -- setup -------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        settings: dict[str, Any] = dict(WORKER_SETTINGS)
        if self.args.durable_submit:
            settings["resilient_durable_submit"] = True
        if self.args.visibility_timeout:
            settings["broker_transport_options"] = {
                "visibility_timeout": self.args.visibility_timeout,
                "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
        return {
            "CHAOS_BROKER": self.redis.url, "CHAOS_STORE_URL": self.server.url,
            "CHAOS_TABLE_PREFIX": PREFIX, "CHAOS_QUEUE": self.queue,
            "CHAOS_EXTRA": json.dumps(settings),
            "RESILIENT_EFFECT_LOG": str(self.effects.path),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }

    def setup(self) -> None:
        self.redis.start()
        self.server.init().start()
        self.store = Store(self.server.url, PREFIX)
        self.store.migrate()
        chaosproj.applied_table(PREFIX).create(self.store.engine)
        for i in range(self.args.tasks):
            kind = self.rng.choices([k for k, _ in MIX], [w for _, w in MIX])[0]
            if kind == "long":
                a: tuple[Any, ...] = (self.rng.randint(20, 60), 0.05)
            elif kind == "short":
                a = (i, round(self.rng.uniform(0.01, 0.05), 3))
            elif kind == "steps":
                a = (0.03,)
            else:
                a = (0.02,)
            self.plan.append((f"chaos-{i:05d}-{kind}", kind, a))
        # the quiet work of each store outage takes the place of random planned tasks
        spots = self.rng.sample(range(self.args.tasks),
                                min(self.args.tasks, QUIET_PER_OUTAGE * self.args.store_outages))
        for n, i in enumerate(spots):
            self.plan[i] = (f"chaos-{i:05d}-quiet", "quiet", (1, QUIET_ROW))
            self.quiet.setdefault(n // QUIET_PER_OUTAGE, []).append(self.plan[i])
        self.held = {task_id for group in self.quiet.values() for task_id, _, _ in group}
        same = min(self.args.same_name, self.args.workers)
        for i in range(self.args.workers):
            # The first --same-name workers share one node name (two workers on one host
            # without -n, host-network containers): neither may take the other's live claims.
            extra = ("-n", SAME_NAME) if i < same else ()
            env, wrapper = self.env(), []
            if self.ns is not None and i == self.args.workers - 1 and i >= same:
                env["CHAOS_BROKER"] = self.redis.url_on(self.ns.host_ip(1))
                env["CHAOS_STORE_URL"] = self.server.url_on(self.ns.host_ip(0))
                wrapper = self.ns.wrapper()
                self.partitioned = i
            worker = LocalWorker(APP, self.dir / "logs", name=f"w{i}",
                                 concurrency=self.args.concurrency, queues=(self.queue,),
                                 env=env, cwd=str(ROOT), extra_args=extra, wrapper=wrapper)
            if extra:
                worker.node_name = SAME_NAME  # the last -n wins; hostname() reports it
            self.workers.append(worker.start())
            self.started_at[i] = time.monotonic()
        self.figures.same_name_workers = same if same > 1 else 0
        log(f"{self.args.workers} workers up ({same if same > 1 else 'none'} named "
            f"{SAME_NAME}); broker {self.redis.url}, store {self.server.name} on "
            f"127.0.0.1:{self.server.port}, "
            f"logs in {self.dir}")

    # -- submission (own thread, own client) ------------------------------------------------

    def submit(self, chaos_seconds: float) -> None:
        client = chaosproj.create_app({**self.env(), "RESILIENT_EFFECT_LOG": os.devnull})
        start = time.monotonic()
        try:
            for n, (task_id, kind, a) in enumerate(self.plan):
                due = start + chaos_seconds * 0.9 * n / max(1, len(self.plan))
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())  # pacing, not waiting on a condition
                if task_id not in self.held:
                    self.send(client, task_id, kind, a, 60)
                self.sent = n + 1
        except BaseException as exc:
            self.send_error = exc
        finally:
            client.close()

    def send(self, client: Any, task_id: str, kind: str, a: tuple[Any, ...],
             patience: float) -> None:
        deadline = time.monotonic() + patience
        while True:
            try:
                # apply_async on the task class: durable submit records it first
                client.tasks[f"chaos.{TASK_OF.get(kind, kind)}"].apply_async(
                    a, task_id=task_id, queue=self.queue, retry=False)
                return
            except Exception as exc:  # broker or store restarting: submit again
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not publish {task_id}: {exc}") from exc
                time.sleep(0.2)

    # -- chaos -------------------------------------------------------------------------------

    def running_claims(self, node: str) -> int:
        """How many claims the store shows running on a node name (0 if it cannot tell)."""
        assert self.store is not None
        w = self.store.t.work
        return self._count(select(w.c.work_key).where(w.c.state == "running",
                                                       w.c.owner_node == node))

    def running_on(self, worker: LocalWorker, pid: int | None = None) -> int:
        """How many claims the store shows running on this worker (or pool process)."""
        assert self.store is not None
        if "store" in self.outages:
            return 0
        w = self.store.t.work
        pids = [pid] if pid is not None else worker.process.children()
        return self._count(select(w.c.work_key).where(
            w.c.state == "running", w.c.owner_node == worker.hostname(),
            w.c.owner_pid.in_(pids)))  # one of a same-name pair

    def _count(self, query: Any) -> int:
        """The rows ``query`` finds (0 when the store does not answer)."""
        assert self.store is not None
        try:
            with self.store.engine.connect() as conn:
                n = len(conn.execute(query).all())
                conn.rollback()
        except Exception:  # the store may be the thing restarting
            return 0
        return n

    def up(self) -> list[int]:
        """Workers running and not being deployed, nor running quiet work through a store
        outage, nor cut from the store (a kill there would prove nothing about the outage or
        the partition)."""
        pids, until = self.protected
        now = time.monotonic()
        guarded = pids if now < until else set()
        return [i for i, w in enumerate(self.workers)
                if w.process.status == "running" and i not in self.stopping
                and now - self.started_at.get(i, 0.0) >= SETTLE  # events that bunched up
                and not (i == self.partitioned and self.cut)
                and not guarded.intersection(w.process.children())]

    def kill_one(self) -> None:
        up = self.up()
        if not up:  # every worker is down, being deployed or spared: kill a little later
            self.schedule(1.0, "kill")
            return
        # A kill where work runs when there is any: an idle worker's death proves little
        # (which one, and when, stay random).
        busy_up = [j for j in up if self.running_on(self.workers[j])]
        i = self.rng.choice(busy_up or up)
        worker = self.workers[i]
        if self.rng.random() < 0.3:
            children = worker.process.children()
            if children:
                busy_children = [c for c in children if self.running_on(worker, c)]
                pid = self.rng.choice(busy_children or children)
                busy = self.running_on(worker, pid)
                try:
                    worker.kill_pool_child(pid)
                except ProcessLookupError:  # killed just before (listed until reaped): later
                    log(f"pool child {pid} of w{i} is gone already; the kill comes later")
                    self.schedule(1.0, "kill")
                    return
                self.kill_log.append((time.time(), {pid}))
                self.figures.kills_child += 1
                log(f"SIGKILL pool child of w{i} ({busy} task(s) running in it)")
                return
        busy = self.running_on(worker)
        self.kill_log.append((time.time(), set(worker.process.children())))
        worker.kill("SIGKILL")
        self.figures.kills_group += 1
        log(f"  w{i} had {busy} task(s) running")
        if self.rng.random() < 0.25 and len(up) > 1:
            pause = LEASE + 2
            self.down_until[i] = time.monotonic() + pause
            self.figures.delayed_restarts += 1
            log(f"SIGKILL w{i} (group); restart in {pause}s (others take over its claims)")
            return
        self.group_restarts += 1
        if self.group_restarts % 2 == 0:  # every other one as a container restart would be
            self.figures.container_restarts += 1
            log(f"SIGKILL w{i} (group); restart at once in a new PID namespace")
            self.restart(i, container=True)
            return
        log(f"SIGKILL w{i} (group); restart now")
        self.restart(i)

    def deploy_one(self) -> None:
        """SIGTERM to one worker's main process only; ``restart_due`` starts it after exit.

        A worker with running work is preferred: its work must hand off for it to exit fast."""
        up = self.up()
        if not up:
            self.schedule(1.0, "deploy")
            return
        running = {i: self.running_on(self.workers[i]) for i in up}
        i = self.rng.choice([i for i in up if running[i]] or up)
        busy = running[i]
        proc = self.workers[i].process.proc
        assert proc is not None
        self.exited_at.pop(i, None)
        self.workers[i].process.kill("SIGTERM", group=False)
        self.stopping[i] = time.monotonic()

        def watch() -> None:  # the exit time, exact even while the chaos loop is busy
            with contextlib.suppress(Exception):
                proc.wait(timeout=DEPLOY_LIMIT + 60)
                self.exited_at[i] = time.monotonic()

        threading.Thread(target=watch, daemon=True, name=f"deploy-w{i}").start()
        self.figures.deploys += 1
        self.figures.deploys_mid_task += bool(busy)
        log(f"deploy w{i}: SIGTERM to its main process ({busy} task(s) running)")

    def deploy_done(self, i: int, now: float) -> None:
        """A deploy's worker exited (or overstayed): record the time, start it again."""
        worker = self.workers[i]
        took = round(self.exited_at.get(i, now) - self.stopping[i], 2)
        if worker.process.status == "running" or took > DEPLOY_LIMIT:
            tail = worker.process.logs().strip().splitlines()[-3:]
            self.figures.violations.append(
                f"deploy of w{i} did not exit within {DEPLOY_LIMIT:.0f}s of SIGTERM; last "
                f"lines: {tail}")
            log(f"deploy w{i}: ran {took}s after SIGTERM; SIGUSR1 (Celery logs every thread's "
                "stack), then SIGKILL")
            before = len(worker.process.logs())
            # The celery main process, not a wrapper (unshare, ip netns exec): a wrapper
            # dies of SIGUSR1, and the group's SIGKILL below skips a process whose wrapper
            # has exited, which would leave the worker running after the soak.
            for pid in [worker.process.main_pid or 0, *worker.process.children()]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1) if pid else None
            time.sleep(2)  # the dumps reach the log; nothing to wait on but the clock
            worker.kill("SIGKILL")
            # Into this run's output, so that a CI failure shows where the worker waited.
            dump = worker.process.logs()[before:].splitlines()[:300]
            log(f"deploy w{i}: its log after SIGUSR1 ({len(dump)} lines):\n"
                + "\n".join(f"    {line}" for line in dump))
        else:
            group_gone(worker, 5)
        del self.stopping[i]
        self.figures.deploy_exit_seconds.append(took)
        self.figures.deploy_exit_max_seconds = max(self.figures.deploy_exit_max_seconds, took)
        log(f"deploy w{i}: exited {took}s after SIGTERM; starting it again")
        self.restart(i)

    def restart(self, i: int, container: bool = False) -> None:
        if self.outages:  # a supervisor's next try: once the broker and the store answer
            self.down_until[i] = 0.0
            log(f"w{i} starts once {' and '.join(sorted(self.outages))} answer(s) again")
            return
        if i == self.partitioned and self.cut:  # it cannot reach the store: after the heal
            self.down_until[i] = 0.0
            log(f"w{i} starts once its store link heals")
            return
        self.down_until.pop(i, None)
        worker = self.workers[i]
        netns = self.ns.wrapper() if self.ns is not None and i == self.partitioned else []
        worker.process.wrapper = [*netns, *(UNSHARE if container else ())]
        for attempt in range(5):
            try:
                worker.restart()
                self.started_at[i] = time.monotonic()
                return
            except (RuntimeError, TimeoutError) as exc:
                log(f"w{i} failed to start (attempt {attempt + 1}): {str(exc)[-300:]}")
                worker.process.kill("SIGKILL")
        raise RuntimeError(f"worker w{i} does not start")

    def restart_due(self) -> None:
        """Restart paused workers whose time came, deployed workers that exited, and (as a
        supervisor would) any that exited on their own."""
        now = time.monotonic()
        for i, since in list(self.stopping.items()):
            if i in self.exited_at or now - since > DEPLOY_LIMIT:
                self.deploy_done(i, now)
        if self.outages:
            return
        for i, until in list(self.down_until.items()):
            if until <= now and not (i == self.partitioned and self.cut):
                self.restart(i)
        for i, worker in enumerate(self.workers):
            if (i not in self.down_until and i not in self.stopping
                    and worker.process.status == "exited"):
                self.figures.unplanned_exits += 1
                tail = worker.process.logs().strip().splitlines()[-1:] or ["(no log)"]
                log(f"w{i} exited on its own; supervisor restarts it. Last line: {tail[0][:200]}")
                self.restart(i)

    def restart_redis(self) -> None:
        if "broker" in self.outages:  # the outage is still on: restart it afterwards
            self.schedule(1.0, "redis")
            return
        log("SIGKILL redis-server; restarting it")
        self.redis.kill()
        self.redis.start()
        self.figures.redis_restarts += 1

    def broker_down(self) -> None:
        log(f"broker outage: SIGKILL redis-server for {self.args.broker_outage_seconds:.0f}s")
        self.redis.kill()
        self.outages.add("broker")
        self.broker_since = time.monotonic()
        self.figures.broker_outages += 1
        self.schedule(self.args.broker_outage_seconds, "broker_up")

    def broker_up(self) -> None:
        self.redis.start()
        self.outages.discard("broker")
        took = round(time.monotonic() - self.broker_since, 1)
        self.figures.broker_outage_seconds = max(self.figures.broker_outage_seconds, took)
        log(f"broker outage over ({took}s)")

    def start_quiet_work(self, outage: int) -> None:
        """Send this outage's quiet work and wait until it runs (behind the queue's backlog:
        up to 30 s, the chaos clock going on meanwhile; the outage starts then)."""
        group = self.quiet.get(outage, [])
        if not group:
            return
        client = chaosproj.create_app({**self.env(), "RESILIENT_EFFECT_LOG": os.devnull})
        try:
            for task_id, kind, a in group:
                self.send(client, task_id, kind, a, 10)
        finally:
            client.close()
        keys = {task_id for task_id, _, _ in group}

        def started() -> set[int]:
            return {int(e["pid"]) for e in self.effects.entries("start") if e["key"] in keys}

        def all_started() -> bool:
            self.restart_due()
            return len(started()) >= len(keys)

        try:
            wait_for(all_started, 30, "the quiet work to start", interval=0.2)
        except TimeoutError:
            log(f"only {len(started())} of {len(keys)} quiet tasks started within 30s")
        self.protected = (started(), time.monotonic() + STORE_OUTAGE + 2 * LEASE)
        log(f"quiet work running in pids {sorted(self.protected[0])} (spared by kills and "
            "deploys until two leases after the outage)")

    def store_down(self) -> None:
        self.start_quiet_work(self.figures.store_outages)
        seconds = STORE_OUTAGE
        log(f"store outage: {self.server.name} {self.server.stopped_how} for {seconds}s, "
            f"longer than the lease ({LEASE}s)")
        self.server.stop_immediately()
        self.outages.add("store")
        self.store_since = time.monotonic()
        self.store_down_wall.append([time.time(), float("inf")])
        self.figures.store_outages += 1
        self.schedule(seconds, "store_up")

    def store_up(self) -> None:
        self.server.start()
        self.store_down_wall[-1][1] = time.time()
        self.outages.discard("store")
        took = round(time.monotonic() - self.store_since, 1)
        self.figures.store_outage_seconds = max(self.figures.store_outage_seconds, took)
        log(f"store outage over ({took}s)")

    def partition(self) -> None:
        """Cut the partitioned worker's store link (no reset) for the lease + 3 s: it must
        fence itself before others take its work, and serve again after the heal.

        The cut waits until the store answers and that worker runs (a cut while the store is
        down, or while the worker is down, proves nothing about a partition), and kills and
        deploys spare the worker while it is cut."""
        if self.ns is None or self.partitioned is None:
            return
        i = self.partitioned
        worker = self.workers[i]
        if ("store" in self.outages or worker.process.status != "running"
                or i in self.stopping or i in self.down_until
                or time.monotonic() - self.started_at.get(i, 0.0) < SETTLE):
            self.schedule(1.0, "partition")
            return
        # by node name alone: its only worker, perhaps in a PID namespace of its own
        claims = self.running_claims(worker.hostname())
        self.figures.partition_claims += claims
        log(f"partition: w{i}'s store link cut for {PARTITION}s (lease {LEASE}s; {claims} "
            "claim(s) running on it)")
        self.ns.cut(0)
        self.cut = True
        self.partition_since = time.monotonic()
        self.figures.partitions += 1
        self.schedule(PARTITION, "heal")

    def heal(self) -> None:
        assert self.ns is not None
        self.ns.heal(0)
        self.cut = False
        took = round(time.monotonic() - self.partition_since, 1)
        self.figures.partition_seconds = max(self.figures.partition_seconds, took)
        log(f"partition healed ({took}s)")

    def restart_store(self) -> None:
        if "store" in self.outages:  # the long outage is still on: restart it afterwards
            self.schedule(1.0, "store_restart")
            return
        log(f"{self.server.name} {self.server.stopped_how}; starting it again")
        self.server.stop_immediately()
        try:
            wait_for(lambda: any("store unavailable" in w.process.logs() or
                                 "maintenance round failed" in w.process.logs()
                                 for w in self.workers), 10, "a worker to notice the outage")
        except TimeoutError:
            log("no worker logged the outage within 10s")
        self.server.start()
        self.figures.store_restarts += 1
        log(f"{self.server.name} is back")

    def schedule(self, after: float, what: str) -> None:
        """An event ``after`` seconds from now (outages schedule their own end)."""
        at = time.monotonic() - self.phase_start + after
        heapq.heappush(self.events, (at, next(self.counter), what))

    def run_chaos(self) -> None:
        a = self.args
        chaos_seconds = a.chaos_seconds or max(30.0, a.kills * 4.0)
        sender = threading.Thread(target=self.submit, args=(chaos_seconds,), daemon=True)
        self.phase_start = start = time.monotonic()
        sender.start()
        planned = (
            [(self.rng.uniform(0.05, 0.95), "kill") for _ in range(a.kills)]
            + [(self.rng.uniform(0.05, 0.9), "deploy") for _ in range(a.deploys)]
            + [(0.15 + 0.1 * n, "broker_down") for n in range(a.broker_outages)]
            + [(0.35 + 0.1 * n, "redis") for n in range(a.redis_restarts)]
            + [(0.45 + 0.1 * n, "store_down") for n in range(a.store_outages)]
            + [(0.8 + 0.05 * n, "store_restart") for n in range(a.store_restarts)]
            + [(0.6 + 0.05 * n, "partition") for n in range(a.partitions)])
        for frac, what in planned:
            heapq.heappush(self.events, (frac * chaos_seconds, next(self.counter), what))
        actions = {"kill": self.kill_one, "deploy": self.deploy_one, "redis": self.restart_redis,
                   "store_restart": self.restart_store, "broker_down": self.broker_down,
                   "broker_up": self.broker_up, "store_down": self.store_down,
                   "store_up": self.store_up, "partition": self.partition,
                   "heal": self.heal}
        while self.events:
            at, _, what = heapq.heappop(self.events)
            while time.monotonic() - start < at:
                self.restart_due()
                self.check_deadline()
                time.sleep(0.05)  # the chaos clock
            actions[what]()
        sender.join(timeout=max(1.0, self.deadline - time.monotonic()))
        if self.send_error is not None:
            raise RuntimeError(f"submission failed: {self.send_error}")
        if sender.is_alive():
            raise TimeoutError("submission did not finish before the deadline")
        while self.stopping:
            self.restart_due()
            self.check_deadline()
            time.sleep(0.05)
        for i in list(self.down_until):
            self.restart(i)
        self.figures.chaos_seconds = round(time.monotonic() - start, 1)

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"--seconds {self.args.seconds} exceeded")

    def states(self) -> dict[str, int]:
        assert self.store is not None
        try:
            return self.store.count_by_state()
        except ResilientError:
            return {}

    def drain(self) -> bool:
        start = time.monotonic()
        last = 0.0
        while time.monotonic() < self.deadline:
            states = self.states()
            if states.get("done", 0) == self.args.tasks:
                self.figures.drain_seconds = round(time.monotonic() - start, 1)
                return True
            self.restart_due()
            if time.monotonic() - last > 10:
                log(f"draining: {states}")
                last = time.monotonic()
            time.sleep(0.2)
        self.figures.drain_seconds = round(time.monotonic() - start, 1)
        return False

    # -- invariants --------------------------------------------------------------------------

    def check(self) -> list[str]:
        assert self.store is not None
        store, f = self.store, self.figures
        bad: list[str] = []
        t = store.t
        # The chaos phase may have restarted the store server after the pool's last use: its
        # connections would fail the first read, so the check starts from fresh ones.
        store.engine.dispose()
        with store.engine.connect() as conn:
            work = {r.work_key: r for r in conn.execute(select(t.work)).all()}
            steps = {(r.work_key, r.name): codec.decode(r.result_json)
                     for r in conn.execute(select(t.steps)).all()}
            ledger = {r.key: r for r in conn.execute(select(t.ledger)).all()}
            checkpoints = {k: (codec.decode(j), int(seq)) for k, (j, seq) in (
                (r.work_key, (r.checkpoint_json, r.checkpoint_seq)) for r in work.values())
                if j is not None}
            applied_t = chaosproj.applied_table(PREFIX)
            applied: dict[str, list[int]] = defaultdict(list)
            for r in conn.execute(select(applied_t.c.work_key, applied_t.c.epoch)).all():
                applied[r.work_key].append(int(r.epoch))
            conn.rollback()
        by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for entry in self.effects.entries():
            by_key[entry["key"]].append(entry)
        planned = {task_id: (kind, a) for task_id, kind, a in self.plan}

        # 1. every task done, nothing else in the store
        for key, stray in work.items():
            if key not in planned:
                bad.append(f"unexpected work row {key} ({stray.state})")
        for key in planned:
            row = work.get(key)
            if row is None or row.state != "done":
                bad.append(f"{key}: not done ({row.state if row else 'no row'})")
        open_rows = [k for k, r in work.items() if r.state != "done"]
        if open_rows:
            bad.append(f"{len(open_rows)} work rows not done (claimed, failed or dead): "
                       f"{open_rows[:10]}")
        f.deaths = sum(int(r.deaths) for r in work.values())
        f.republished = sum(int(r.republished) for r in work.values())
        f.by_kind = {k: sum(1 for _, kind, _ in self.plan if kind == k)
                     for k in [k for k, _ in MIX] + ["quiet"]}

        for key, (kind, a) in planned.items():
            row = work.get(key)
            if row is not None and row.state == "done":
                bad += self._check_work(key, kind, a, row, by_key.get(key, []), steps, ledger,
                                        checkpoints, applied)
            f.quiet_through_store_outage += quiet_through(by_key.get(key, []),
                                                          self.store_down_wall)
            found, refused = overlaps(key, by_key.get(key, []))
            f.overlaps += len(found)
            f.fenced_writes += refused
            bad += found
        f.kills_mid_task = killed_mid_task(by_key, self.kill_log)
        logs = "".join(w.process.all_logs() for w in self.workers)
        f.handed_off = len(re.findall(r"handed off work \S+ at epoch", logs))
        f.same_name_warnings = logs.count("ANOTHER LIVE WORKER USES THE NODE NAME")
        f.self_fenced = logs.count("SELF-FENCING (")
        return bad

    def _check_work(self, key: str, kind: str, a: tuple[Any, ...], row: Any,
                    entries: list[dict[str, Any]], steps: dict[tuple[str, str], Any],
                    ledger: dict[str, Any], checkpoints: dict[str, tuple[Any, int]],
                    applied: dict[str, list[int]]) -> list[str]:
        bad: list[str] = []
        f = self.figures
        final = int(row.epoch)
        # 6. nothing ran after done; the finishing epoch recorded its effects
        late = [e for e in entries if int(e["epoch"]) > final]
        if late:
            bad.append(f"{key}: effects from epochs after the final epoch {final}: {late[:3]}")
        # (a long task handed off after its last row resumes with nothing left but to finish)
        shown = {"long": ("start", "cp"), "quiet": ("start", "cp"),
                 "short": ("short",)}.get(kind, ())
        if shown and not any(int(e["epoch"]) == final and e["effect"] in shown
                             for e in entries):
            bad.append(f"{key}: the finishing epoch {final} recorded no effect")
        if kind in ("long", "quiet"):
            bad += self._check_long(key, a[0], entries, row, steps, ledger, checkpoints)
        elif kind == "short":
            epochs = [int(e["epoch"]) for e in entries if e["effect"] == "short"]
            if not epochs or len(epochs) != len(set(epochs)):
                bad.append(f"{key}: short effect epochs {epochs} (missing or repeated "
                           "within one execution)")
            f.short_repeated += max(0, len(epochs) - 1)
            if codec.decode(row.result_json) != a[0] * 2:
                bad.append(f"{key}: result {row.result_json!r}")
        elif kind == "steps":
            results = []
            for name in ("a", "b", "c"):
                results.append(steps.get((key, name)))
                bad += self._check_once(key, f"step {name}", steps.get((key, name)),
                                        [e for e in entries if e["effect"] == "step"
                                         and e.get("step") == name], "step")
            if codec.decode(row.result_json) != results:
                bad.append(f"{key}: result {row.result_json!r} is not the stored steps "
                           f"{results}")
        else:
            rows = applied.get(key, [])
            marker = ledger.get(f"{key}:atomic")
            if len(rows) != 1:
                bad.append(f"{key}: ledger.atomic write applied {len(rows)} times {rows}")
            elif marker is None or codec.decode(marker.result_json) != rows[0]:
                bad.append(f"{key}: atomic marker {marker and marker.result_json} does not "
                           f"match the write of epoch {rows[0]}")
        return bad

    def _check_once(self, key: str, what: str, stored: Any, lines: list[dict[str, Any]],
                    counter: str) -> list[str]:
        epochs = [int(e["epoch"]) for e in lines]
        bad: list[str] = []
        if stored is None:
            return [f"{key}: {what} has no stored result"]
        if stored not in epochs:
            bad.append(f"{key}: {what} stored epoch {stored} but its effect was never recorded "
                       f"(recorded: {epochs})")
        if len(epochs) != len(set(epochs)):
            bad.append(f"{key}: {what} effect ran twice in one execution: {epochs}")
        after = [e for e in epochs if e > stored]
        if after:
            bad.append(f"{key}: {what} effect ran again after its marker was stored "
                       f"(stored by epoch {stored}, re-run by {after})")
        repeats = max(0, len(epochs) - 1)
        if counter == "step":
            self.figures.step_effects_repeated += repeats
        else:
            self.figures.ledger_effects_repeated += repeats
        return bad

    def _check_long(self, key: str, rows: int, entries: list[dict[str, Any]], row: Any,
                    steps: dict[tuple[str, str], Any], ledger: dict[str, Any],
                    checkpoints: dict[str, tuple[Any, int]]) -> list[str]:
        bad: list[str] = []
        starts = [e for e in entries if e["effect"] == "start"]
        if len(starts) > 1:
            self.figures.resumed_long += 1
        # 4. checkpoints never go backwards
        last_row, last_seq = 0, 0
        for e in entries:
            if e["effect"] == "start" and int(e["row"]) < last_row:
                bad.append(f"{key}: epoch {e['epoch']} resumed at row {e['row']}, behind the "
                           f"logged checkpoint {last_row}")
            if e["effect"] == "cp":
                if int(e["seq"]) <= last_seq or int(e["row"]) <= last_row:
                    bad.append(f"{key}: checkpoint went backwards: seq {e['seq']} row "
                               f"{e['row']} after seq {last_seq} row {last_row}")
                last_row, last_seq = int(e["row"]), int(e["seq"])
        final = checkpoints.get(key)
        if final is None or final[0] != {"row": rows} or final[1] < last_seq:
            bad.append(f"{key}: final checkpoint {final} (expected row {rows}, seq >= {last_seq})")
        # 5. rows
        by_epoch: dict[int, list[int]] = defaultdict(list)
        for e in entries:
            if e["effect"] == "row":
                by_epoch[int(e["epoch"])].append(int(e["row"]))
        ran = {r for rs in by_epoch.values() for r in rs}
        if ran != set(range(rows)):
            bad.append(f"{key}: rows never run: {sorted(set(range(rows)) - ran)}")
        for epoch, rs in by_epoch.items():
            if len(rs) != len(set(rs)):
                bad.append(f"{key}: a row ran twice in epoch {epoch}: {rs}")
        ordered = sorted((int(s["epoch"]), int(s["row"])) for s in starts)
        for (e1, s1), (e2, s2) in itertools.pairwise(ordered):
            done = by_epoch.get(e1, [])
            allowed = {max(done), max(done) + 1} if done else {s1}
            if s2 not in allowed:
                bad.append(f"{key}: epoch {e2} resumed at row {s2} after epoch {e1} ran rows "
                           f"{s1}..{max(done) if done else '-'} (allowed: {sorted(allowed)})")
        self.figures.rows_repeated += sum(len(rs) for rs in by_epoch.values()) - len(ran)
        # 2. the step and the ledger effect
        step_lines = [e for e in entries if e["effect"] == "step"]
        bad += self._check_once(key, "step finish", steps.get((key, "finish")), step_lines,
                                "step")
        marker = ledger.get(f"charge:{key}")
        stored = codec.decode(marker.result_json) if marker is not None else None
        bad += self._check_once(key, "ledger charge", stored,
                                [e for e in entries if e["effect"] == "ledger"], "ledger")
        result = codec.decode(row.result_json)
        expected = {"rows": rows, "step": steps.get((key, "finish")), "ledger": stored}
        if result != expected:
            bad.append(f"{key}: result {result} != {expected}")
        return bad

    # -- main --------------------------------------------------------------------------------

    def run(self) -> int:
        begin = time.monotonic()
        self.deadline = begin + self.args.seconds
        code = 0
        try:
            self.setup()
            self.run_chaos()
            log(f"chaos phase over ({self.figures.chaos_seconds}s); draining")
            if not self.drain():
                self.figures.violations.append(
                    f"not every task finished within --seconds {self.args.seconds}: "
                    f"{self.states()}")
                code = 2
            self.figures.violations += self.check()
        except TimeoutError as exc:
            self.figures.violations.append(f"deadline: {exc}")
            code = 2
        finally:
            self.figures.total_seconds = round(time.monotonic() - begin, 1)
            for w in self.workers:
                w.process.teardown()
            if self.store is not None:
                self.store.dispose()
            self.redis.destroy()
            self.server.destroy()
            if self.ns is not None:
                self.ns.destroy()
        if self.figures.violations and code == 0:
            code = 1
        self.report(code)
        if code == 0 and not self.args.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        return code

    def report(self, code: int) -> None:
        f = self.figures
        print(f"CHAOS-SUMMARY {json.dumps(asdict(f), sort_keys=True)}", flush=True)
        print(f"\n{f.tasks} tasks {f.by_kind} on {f.workers} workers x {self.args.concurrency}"
              f": {f.kills_group} group SIGKILLs ({f.delayed_restarts} restarted after the "
              f"lease), {f.kills_child} pool-child SIGKILLs, {f.redis_restarts} Redis and "
              f"{f.store_restarts} {self.server.name} restarts; {f.kills_mid_task} kills hit "
              "running work")
        print(f"{f.deploys} deploys (SIGTERM, exit in at most {f.deploy_exit_max_seconds}s; "
              f"{f.handed_off} executions handed off), {f.same_name_workers} workers under one "
              f"node name ({f.same_name_warnings} warnings logged), {f.broker_outages} broker "
              f"outage(s) of {f.broker_outage_seconds}s, {f.store_outages} store outage(s) of "
              f"{f.store_outage_seconds}s (lease {LEASE}s)")
        print(f"{f.container_restarts} restarts in a new PID namespace; {f.partitions} "
              f"partition(s) of {f.partition_seconds}s ({f.partition_claims} claim(s) running "
              f"on the worker cut); {f.self_fenced} self-fencing(s)")
        print(f"overlapping executions {f.overlaps}; writes refused by the fence "
              f"{f.fenced_writes}; executions alive through the store outage "
              f"{f.quiet_through_store_outage}")
        if f.unplanned_exits:
            print(f"{f.unplanned_exits} worker exit(s) nobody asked for (restarted as a "
                  "supervisor would; see docs/reliability.md)")
        print(f"chaos {f.chaos_seconds}s, drain {f.drain_seconds}s, total {f.total_seconds}s; "
              f"deaths {f.deaths}, re-published {f.republished}, long tasks resumed "
              f"{f.resumed_long}")
        print(f"outside-store repeats (allowed: the in-flight effect of a killed execution): "
              f"rows {f.rows_repeated}, short {f.short_repeated}, step effects "
              f"{f.step_effects_repeated}, ledger effects {f.ledger_effects_repeated}")
        if f.violations:
            print(f"\n{len(f.violations)} INVARIANT VIOLATION(S) (logs kept in {self.dir}):")
            for v in f.violations[:50]:
                print(f"  - {v}")
        else:
            print("all invariants hold")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seconds", type=float, default=1800, help="hard deadline for the run")
    p.add_argument("--chaos-seconds", type=float, default=0,
                   help="length of the chaos phase (default: 4 s per kill, at least 30 s)")
    p.add_argument("--redis-restarts", type=int, default=1)
    p.add_argument("--store", choices=sorted(STORE_SERVERS), default="postgresql",
                   help="the store's throwaway server, which every store fault hits")
    p.add_argument("--store-restarts", "--pg-restarts", type=int, default=1,
                   help="times the store server is stopped at once and started again")
    p.add_argument("--deploys", type=int, default=None,
                   help="SIGTERMs to a worker's main process, then a start (default: kills/5)")
    p.add_argument("--same-name", type=int, default=2,
                   help="how many workers share one node name (-n same@%%h); 0 or 1: none")
    p.add_argument("--broker-outages", type=int, default=1)
    p.add_argument("--broker-outage-seconds", type=float, default=6.0)
    p.add_argument("--store-outages", type=int, default=1,
                   help="the store server stopped for the lease + 3 s")
    p.add_argument("--partitions", type=int, default=1,
                   help="times one worker (run in a network namespace) has its store link "
                   "cut for the lease + 3 s; 0: no namespace")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true", help="keep logs and effect log")
    p.add_argument("--visibility-timeout", type=float, default=0,
                   help="Redis visibility_timeout for the workers (default: Redis's 3600 s). "
                   "A message a worker fetched while the store was down and never recorded "
                   "(the worker was killed before the store came back) returns only then")
    p.add_argument("--durable-submit", action="store_true",
                   help="with resilient_durable_submit (the default is a user's default: off; "
                   "a submitted task is then only in the broker until a worker records it)")
    args = p.parse_args(argv)
    if args.deploys is None:
        args.deploys = max(1, args.kills // 5)
    if args.seed is None:
        args.seed = random.randrange(1_000_000)
    log(f"seed {args.seed}")
    return Chaos(args).run()


if __name__ == "__main__":
    sys.exit(main())
