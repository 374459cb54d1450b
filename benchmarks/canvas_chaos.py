"""Canvas under random SIGKILLs and deploys: ResumableTask against plain Celery ``acks_late``.

Chords, chains, groups of chains, chains ending in a chord and chords whose header fails
(``link_error`` on the body) are sent to real workers (Redis broker and result backend with
their defaults: a one-hour visibility timeout; no durable submit; the store on the machine's
PostgreSQL or, ``--store mariadb``, MariaDB server, tables under a prefix of the run's own,
dropped afterwards), which are
SIGKILLed at random (whole process group, restarted at once under the same node name, or one
pool process) and deployed at random (SIGTERM to the main process only, as a deploy does; a
warm shutdown longer than 30 s is counted as slow, then SIGKILLed; started again once it has
exited). Afterwards, with no more of either, every canvas has a deadline to end. Counted
per canvas kind: hung (its result not ready by the deadline), wrong (a result other than the
expected one), and from the effect log (one fsync'd line per completed body): chord bodies run
more than once, errbacks run 0 or 2+ times.

    python benchmarks/canvas_chaos.py [--seeds 1 2 3] [--kills 12] [--deploys 4]
                                      [--modes resumable plain] [--store mariadb]

Prints a markdown table per mode and ``CANVAS-SUMMARY <json>`` lines (tests/chaos).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from bench_common import HERE, Worker, machine, markdown_table, wait_for
from celery import chain, chord, group

from celery_resilient.store.sql import Store
from celery_resilient.testing import EffectLog
from celery_resilient.testing.clients import close_result_client
from celery_resilient.testing.services import drop_prefixed_tables

sys.path.insert(0, str(HERE))
REDIS = os.environ.get("CANVAS_REDIS", "redis://127.0.0.1:6379/14")  # broker and backend
#: The store of each ``--store``: the machine's servers (the test suite's URLs).
STORES = {
    "postgresql": os.environ.get("RESILIENT_TEST_PG_URL",
                                 "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mariadb": os.environ.get("RESILIENT_TEST_MYSQL_URL",
                              "mysql+pymysql://root@127.0.0.1:3306/test"),
}
KINDS = ("chord", "chain", "group of chains", "chain to chord", "chord link_error")
#: seconds from a deploy's SIGTERM to its worker's exit; longer is a slow deploy (a hang)
DEPLOY_LIMIT = 30.0


def _client(env: dict[str, str]) -> Any:
    """The app module, imported afresh for this run's mode and queue."""
    os.environ.update(env)
    sys.modules.pop("canvas_app", None)
    return importlib.import_module("canvas_app")


def _send(app: Any, rng: random.Random, scale: int) -> list[tuple[str, str, Any, Any]]:
    """(kind, tag, result, expected) for each canvas sent."""
    add, tsum, boom, errback = app.add, app.tsum, app.boom, app.errback
    sent: list[tuple[str, str, Any, Any]] = []

    def pause() -> float:
        return round(rng.uniform(0.05, 0.4), 3)

    for i in range(2 * scale):
        tag = f"chord-{i}"
        headers = [add.si(j, j, pause()) for j in range(10)]
        sent.append(("chord", tag, chord(headers, tsum.s(tag)).apply_async(), 90))
    for i in range(4 * scale):
        links = chain(add.si(0, 1, pause()), *[add.s(1, pause()) for _ in range(4)])
        sent.append(("chain", f"chain-{i}", links.apply_async(), 5))
    for i in range(scale):
        chains = group(chain(add.si(k, 1, pause()), add.s(1, pause())) for k in range(3))
        sent.append(("group of chains", f"group-{i}", chains.apply_async(), [2, 3, 4]))
    for i in range(scale):
        tag = f"tochord-{i}"
        tail = chord([add.si(j, 1, pause()) for j in range(4)], tsum.s(tag))
        sent.append(("chain to chord", tag,
                     chain(add.si(1, 1, pause()), tail).apply_async(), 10))
    for i in range(scale):
        tag = f"errback-{i}"
        body = tsum.s(tag).on_error(errback.si(tag=tag))
        headers = [add.si(1, 1, pause()), boom.si(tag, pause())]
        sent.append(("chord link_error", tag, chord(headers, body).apply_async(), "error"))
    return sent


def _outcome(result: Any, expected: Any) -> str:
    if not result.ready():
        return "hung"
    if expected == "error":
        return "ok" if result.failed() else "wrong"
    try:
        value = result.get(timeout=5, propagate=True)
    except Exception:
        return "wrong"
    return "ok" if value == expected else "wrong"


def _ready(result: Any) -> bool:
    try:
        return bool(result.ready())
    except Exception:
        return False


def _kill_one(fleet: list[Worker], rng: random.Random, figures: Counter[str],
              starts: Counter[str], log_dir: Path) -> None:
    """One SIGKILL a random while from now: a pool process (30 %), or a whole worker,
    restarted at once under its node name."""
    time.sleep(rng.uniform(0.5, 3.0))  # the kill schedule, not a wait
    worker = fleet[rng.randrange(len(fleet))]
    children = worker.pids()[1:]
    if children and rng.random() < 0.3:
        os.kill(rng.choice(children), signal.SIGKILL)
        figures["kills_child"] += 1
        return
    figures["kills_group"] += 1
    _restart(worker, starts, log_dir)


def _restart(worker: Worker, starts: Counter[str], log_dir: Path) -> None:
    """SIGKILL what is left of the worker's process group, then start it again (new log)."""
    assert worker.proc is not None
    with contextlib.suppress(ProcessLookupError):  # after a deploy: gone already
        os.killpg(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    starts[worker.name] += 1
    worker.log_path = log_dir / f"{worker.name}.{starts[worker.name]}.log"
    worker.start()


def _deploy_one(fleet: list[Worker], rng: random.Random, figures: Counter[str],
                starts: Counter[str], log_dir: Path, exits: list[float], app: Any,
                results: list[Any]) -> None:
    """One deploy a random while from now: SIGTERM to a worker's main process only (its
    pool processes get what Celery's warm shutdown gives them), then started again. The
    worker is first seen answering a ping: a SIGTERM to one still starting proves nothing.
    One that exited on its own meanwhile is started again, as a supervisor would (Celery
    exits when a pool process dies before the pool is up: a kill of a worker just started)."""
    time.sleep(rng.uniform(0.5, 3.0))  # the deploy schedule, not a wait
    worker = fleet[rng.randrange(len(fleet))]
    node = f"{worker.name}@{socket.gethostname()}"

    def answers() -> bool:
        if not worker.alive():
            figures["unplanned_exits"] += 1
            _restart(worker, starts, log_dir)
            return False
        return bool(app.control.ping(destination=[node], timeout=0.5))

    wait_for(answers, 90, f"{node} to answer a ping before its deploy")
    figures["deploys_mid_canvas"] += not all(_ready(r) for r in results)
    sent = time.monotonic()
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    try:
        worker.proc.wait(timeout=DEPLOY_LIMIT)
    except subprocess.TimeoutExpired:
        figures["deploys_slow"] += 1
    exits.append(round(time.monotonic() - sent, 2))
    figures["deploys"] += 1
    _restart(worker, starts, log_dir)  # a slow one is SIGKILLed there


def run(mode: str, seed: int, kills: int, workers: int, scale: int, deadline: float,
        workdir: Path, deploys: int = 0, store_kind: str = "postgresql") -> dict[str, Any]:
    rng = random.Random(seed)
    store_url = STORES[store_kind]
    queue = f"canvas-{mode}-{uuid.uuid4().hex[:6]}"
    prefix = f"cc_{uuid.uuid4().hex[:6]}_"
    log_dir = workdir / f"{mode}-{seed}"
    log_dir.mkdir(parents=True)
    effects_path = log_dir / "effects.jsonl"
    env = {"CANVAS_MODE": mode, "CANVAS_REDIS": REDIS, "CANVAS_STORE": store_url,
           "CANVAS_PREFIX": prefix, "CANVAS_EFFECTS": str(effects_path),
           "CANVAS_QUEUE": queue}
    store = Store(store_url, prefix)
    if mode == "resumable":
        store.migrate()
    fleet = [Worker(f"cc{i}", env, queue, log_dir, app="canvas_app").start()
             for i in range(workers)]
    starts: Counter[str] = Counter()
    canvas = _client(env)
    app = canvas.app
    figures: Counter[str] = Counter()
    exits: list[float] = []
    disruptions = ["kill"] * kills + ["deploy"] * deploys
    rng.shuffle(disruptions)
    if deploys:  # the first is a deploy: at least one lands while the canvases run
        disruptions.remove("deploy")
        disruptions.insert(0, "deploy")
    try:
        wait_for(lambda: len(app.control.ping(timeout=0.5)) >= workers, 90,
                 "every worker to answer a ping")
        sent = _send(canvas, rng, scale)
        results = [r for _, _, r, _ in sent]
        for disruption in disruptions:
            if disruption == "kill":
                _kill_one(fleet, rng, figures, starts, log_dir)
            else:
                _deploy_one(fleet, rng, figures, starts, log_dir, exits, app, results)
        end = time.monotonic() + deadline
        while time.monotonic() < end and not all(_ready(r) for r in results):
            time.sleep(0.5)  # polling the backend until the deadline
        tally = _tally(sent, EffectLog(effects_path))
        del sent, results  # collected by close_result_client while its connection works
    finally:
        for worker in fleet:
            worker.stop()
        close_result_client(app)
        store.dispose()
        if mode == "resumable":
            drop_prefixed_tables(store_url, prefix)
        _clean(queue)
    return {"mode": mode, "seed": seed, "store": store_kind, **figures,
            "deploy_exit_seconds": exits, "deploy_exit_max_seconds": max(exits, default=0.0),
            **tally}


def _tally(sent: list[tuple[str, str, Any, Any]], log: EffectLog) -> dict[str, Any]:
    table: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    for kind, _tag, result, expected in sent:
        table[kind]["sent"] += 1
        table[kind][_outcome(result, expected)] += 1
    bodies = Counter(e["tag"] for e in log.entries("tsum"))
    errbacks = Counter(e["tag"] for e in log.entries("errback"))
    errback_tags = [tag for kind, tag, _, _ in sent if kind == "chord link_error"]
    return {"table": {k: dict(v) for k, v in table.items()},
            "hung": sum(v["hung"] for v in table.values()),
            "wrong": sum(v["wrong"] for v in table.values()),
            "chord_body_twice": sum(1 for n in bodies.values() if n > 1),
            "errback_lost": sum(1 for tag in errback_tags if errbacks[tag] == 0),
            "errback_twice": sum(1 for tag in errback_tags if errbacks[tag] > 1)}


def _clean(queue: str) -> None:
    r = redis.Redis.from_url(REDIS)
    try:
        r.delete(queue)
        for tag, entry in r.hgetall("unacked").items():  # plain mode's leftovers
            if json.loads(entry)[2] == queue:
                r.hdel("unacked", tag)
                r.zrem("unacked_index", tag)
    finally:
        r.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--modes", nargs="+", default=["resumable", "plain"])
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--deploys", type=int, default=4,
                        help="SIGTERMs to a worker's main process, among the kills")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--scale", type=int, default=3, help="canvases per kind, x1-x4")
    parser.add_argument("--deadline", type=float, default=60)
    parser.add_argument("--store", choices=sorted(STORES), default="postgresql",
                        help="the store of the resumable mode (the machine's server)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="canvas-chaos-"))
    summaries = []
    for seed in args.seeds:
        for mode in args.modes:
            summary = run(mode, seed, args.kills, args.workers, args.scale, args.deadline,
                          workdir, deploys=args.deploys, store_kind=args.store)
            summaries.append(summary)
            print("CANVAS-SUMMARY " + json.dumps(summary), flush=True)
    print(f"{machine()}; store: {args.store} (resumable mode)")
    print(f"logs: {workdir}")
    rows = []
    for s in summaries:
        cells = [f"{s['table'][k].get('hung', 0)}/{s['table'][k].get('wrong', 0)} of "
                 f"{s['table'][k].get('sent', 0)}" for k in KINDS]
        rows.append([s["mode"], s["seed"], s.get("kills_group", 0) + s.get("kills_child", 0),
                     f"{s.get('deploys', 0)} ({s.get('deploys_mid_canvas', 0)} mid-canvas, "
                     f"{s.get('deploys_slow', 0)} slow, max "
                     f"{s['deploy_exit_max_seconds']:.1f}s)",
                     *cells, s["chord_body_twice"],
                     f"{s['errback_lost']}/{s['errback_twice']}"])
    print(markdown_table(["mode", "seed", "kills", "deploys",
                          *(f"{k} hung/wrong" for k in KINDS),
                          "chord bodies twice", "errbacks lost/twice"], rows))


if __name__ == "__main__":
    main()
