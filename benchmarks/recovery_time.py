"""Time from a SIGKILL + restart to the orphaned work running again: ours vs plain Celery.

For each broker (Redis with its default visibility timeout, RabbitMQ, kombu's SQLAlchemy
transport on SQLite) and each mode (plain Celery with acks_late + reject_on_worker_lost, and
ResumableTask), in the same run: a worker (-c 1, prefetch x4) runs one slow task with two more
prefetched; the worker's process group is SIGKILLed and restarted at once; we measure how long
after the restarted worker is ready the killed task starts again, and whether all three finish.

    python benchmarks/recovery_time.py [--cap 90] [--brokers redis,rabbitmq,sqlalchemy]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench_common import machine, markdown_table
from celery import Celery

from celery_resilient.store.sql import Store
from celery_resilient.testing.effects import EffectLog
from celery_resilient.testing.process import LocalProcess

HERE = Path(__file__).resolve().parent
BROKERS = {
    "redis": lambda tmp: "redis://127.0.0.1:6379/12",
    "rabbitmq": lambda tmp: "amqp://guest:guest@127.0.0.1:5672//",
    "sqlalchemy": lambda tmp: f"sqla+sqlite:///{tmp}/broker.sqlite3",
}


def first_time(effects: EffectLog, name: str, nth: int) -> float | None:
    times = [e["at"] for e in effects.entries() if e["effect"] == name]
    return times[nth - 1] if len(times) >= nth else None


def run_case(broker_name: str, mode: str, cap: float, tmp: Path, pg_url: str) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    broker = BROKERS[broker_name](tmp)
    queue = f"recovery-{mode}-{tag}"
    effects = EffectLog(tmp / f"effects-{broker_name}-{mode}.jsonl")
    env = {"RECOVERY_MODE": mode, "RECOVERY_BROKER": broker, "RECOVERY_QUEUE": queue,
           "RECOVERY_EFFECT_LOG": str(effects.path), "RECOVERY_STORE_URL": pg_url,
           "RECOVERY_TABLE_PREFIX": f"rec{tag}_",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    store = None
    if mode == "resilient":
        store = Store(pg_url, f"rec{tag}_")
        store.migrate()
    worker = LocalProcess(f"{broker_name}-{mode}", ["-A", "recovery_app", "worker", "-c", "1",
                                                    "-Q", queue, "-l", "WARNING", "-n",
                                                    f"rec-{mode}@%h", "--without-gossip",
                                                    "--without-mingle"],
                          tmp / "logs", env=env, cwd=str(HERE), ready_prompt="")
    client = Celery("recovery-client", broker=broker, set_as_current=False)
    try:
        worker.start(wait=False)
        ids = [client.send_task("recovery.slow", args=(s,), queue=queue).id
               for s in (6.0, 0.5, 0.5)]
        deadline = time.monotonic() + 60
        while first_time(effects, f"start:{ids[0]}", 1) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{broker_name}/{mode}: first task never started\n"
                                   f"{worker.logs()[-2000:]}")
            time.sleep(0.02)
        time.sleep(0.5)  # let the other two be prefetched
        worker.kill("SIGKILL")
        killed = time.time()
        worker.start(wait=False)
        deadline = time.monotonic() + cap
        rerun = None
        while time.monotonic() < deadline:
            rerun = first_time(effects, f"start:{ids[0]}", 2)
            if rerun is not None and all(first_time(effects, f"end:{i}", 1) for i in ids):
                break
            time.sleep(0.05)
        finished = sum(1 for i in ids if first_time(effects, f"end:{i}", 1))
        runs = {i: effects.count(f"start:{i}") for i in ids}
        again = f"{rerun - killed:.1f} s" if rerun else f"not within {cap:.0f} s"
        return [broker_name, mode, again, f"{finished}/3",
                ", ".join(str(runs[i]) for i in ids)]
    finally:
        worker.teardown()
        client.close()
        if store is not None:
            store.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=90.0, help="seconds to wait per case")
    parser.add_argument("--brokers", default="redis,rabbitmq,sqlalchemy")
    parser.add_argument("--pg-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/test")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    print(f"machine: {machine()}")
    print("one 6 s task running + two prefetched; SIGKILL of the worker's process group; "
          "restart at once\n", flush=True)
    rows = []
    for broker in [b.strip() for b in args.brokers.split(",") if b.strip()]:
        for mode in ("plain", "resilient"):
            rows.append(run_case(broker, mode, args.cap, tmp, args.pg_url))
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(markdown_table(["broker", "mode", "killed task running again after the kill",
                          "finished", "starts per task"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
