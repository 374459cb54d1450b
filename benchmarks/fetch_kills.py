"""What a SIGKILL in the middle of fetching does to Redis messages: kombu's fetch vs ours.

A real consumer process takes messages as fast as it can and never acknowledges them (as a
worker's prefetch does); it is SIGKILLed at a random moment 0-300 ms after its first message,
and counted where every message is: back in its queue, in Redis's ``unacked`` hash (kombu:
back only after the visibility timeout, an hour by default, run by a live consumer), or
nowhere (lost). With the reliable fetch the dead consumer's holding is given back at once,
as the worker's sweep does. Both transports, the same kills, the same run.

    python benchmarks/fetch_kills.py [--kills 50] [--messages 5000]
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from bench_common import ROOT, machine, markdown_table
from kombu import Connection, Exchange, Queue

from celery_resilient.broker import holdings

URL = "redis://127.0.0.1:6379/13"
RELIABLE = "celery_resilient.broker.transport:Transport"


def _bodies(r: redis.Redis, name: str) -> tuple[set[int], set[int]]:
    """Bodies in the queue, and bodies in ``unacked`` (kombu's format) for this queue."""
    queued = {_body(json.loads(m)) for m in r.lrange(name, 0, -1)}
    unacked = set()
    for entry in r.hvals("unacked"):
        payload, _exchange, routing_key = json.loads(entry)
        if routing_key == name:
            unacked.add(_body(payload))
    return queued, unacked


def _body(payload: dict[str, object]) -> int:
    body = payload["body"]
    assert isinstance(body, str)
    return int(json.loads(base64.b64decode(body)))


def run(transport: str, kills: int, total: int, seed: int, workdir: Path) -> dict[str, int]:
    r = redis.Redis.from_url(URL)
    name = f"fetch-kills-{transport}-{uuid.uuid4().hex[:6]}"
    done_log = workdir / f"{name}.done"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with Connection(URL) as conn:
        producer = conn.Producer()
        for i in range(total):
            producer.publish(i, exchange=queue.exchange, routing_key=name, declare=[queue])
    rng = random.Random(seed)
    lost: set[int] = set()
    lost_kills = stranded_kills = 0
    stranded: set[int] = set()
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-m", "tests.integration.fetch_consumer", URL,
                                 name, transport, str(done_log)], stdout=subprocess.PIPE,
                                text=True, cwd=ROOT)
        assert proc.stdout is not None
        incarnation = proc.stdout.readline().split()[1]
        if not proc.stdout.readline():  # its first message
            break
        time.sleep(rng.uniform(0, 0.3))
        proc.kill()
        proc.wait()
        proc.stdout.close()
        if transport == "reliable":  # what the worker's sweep does for a gone incarnation
            with Connection(URL, transport=RELIABLE) as conn:
                holdings.restore(conn.default_channel, incarnation)
        queued, unacked = _bodies(r, name)
        done = {int(line) for line in done_log.read_text().split()}
        missing = set(range(total)) - queued - unacked - done
        lost_kills += bool(missing - lost)
        stranded_kills += bool(unacked - stranded)
        lost, stranded = missing, unacked
        if not queued:
            break
    for tag, entry in r.hgetall("unacked").items():  # leave nothing behind
        if json.loads(entry)[2] == name:
            r.hdel("unacked", tag)
            r.zrem("unacked_index", tag)
    r.delete(name)
    return {"kills": kills, "lost": len(lost), "kills that lost": lost_kills,
            "left to the visibility timeout": len(stranded),
            "kills that left some": stranded_kills}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="fetch-kills-"))
    for transport in ("kombu", "reliable"):
        result = run(transport, args.kills, args.messages, args.seed, workdir)
        rows.append([transport, *(str(v) for v in result.values())])
    print(machine())
    print(markdown_table(["fetch", "kills", "messages lost", "kills that lost one",
                          "messages left in unacked", "kills that left some"], rows))


if __name__ == "__main__":
    main()
