"""The chaos soak at CI size: 300 tasks, 3 workers (two of them under one node name, one in a
network namespace), 10 SIGKILLs (every other whole-worker restart in a new PID namespace, as
a container restart), 3 deploys (SIGTERM to a worker's main process: its work hands off), one
Redis and one store server restart, a broker outage of 6 s, a store outage longer than the
lease, and one worker's store link cut without a reset for longer than the lease (throwaway
servers of the run's own), every invariant checked (``benchmarks/chaos.py``), including "no
two executions of one unit overlap". Once with a PostgreSQL store, once with a MariaDB store:
every store fault hits the server that runs.

With the defaults a user has: Redis's one-hour visibility timeout and no durable submit. A
message a worker held when it was killed comes back from that worker's holding in the broker
(the reliable fetch), not from the visibility timeout; a task that never ends is a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos import overlaps

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.chaos
ARGV = ["--tasks", "300", "--workers", "3", "--kills", "10", "--deploys", "3",
        "--chaos-seconds", "60", "--seconds", "240"]


@pytest.mark.parametrize("store", ["postgresql", "mariadb"])
@pytest.mark.timeout(330)
@pytest.mark.xdist_group("netns")  # a network namespace: one at a time (test_partitions.py)
def test_chaos_small(store: str) -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), *ARGV, "--store", store]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    out = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("CHAOS-SUMMARY ")]
    assert lines, out[-6000:]
    summary = json.loads(lines[-1].split(" ", 1)[1])
    assert done.returncode == 0, f"invariants violated:\n{_telling(out)}"
    assert summary["violations"] == []
    assert summary["overlaps"] == 0
    assert summary["tasks"] == 300 and summary["store"] == store
    assert summary["kills_group"] + summary["kills_child"] == 10
    assert summary["kills_mid_task"] >= 3, "the kills hit no running work: the soak proved little"
    assert summary["redis_restarts"] == 1 and summary["store_restarts"] == 1
    assert summary["resumed_long"] >= 1, "no long task was resumed from a checkpoint"
    assert summary["deploys"] == 3, out[-3000:]
    assert summary["deploy_exit_max_seconds"] <= 45  # 2-3 s typical; 30 s at an outage's start
    assert summary["same_name_workers"] == 2 and summary["same_name_warnings"] >= 1
    assert summary["store_outages"] == 1
    assert summary["store_outage_seconds"] > 6, "the store outage was not longer than the lease"
    # The outage (9 s) is longer than the lease (6 s) minus the fence margin (1 s): workers
    # fence their resumable executions first (the quiet work resumes after it).
    assert summary["self_fenced"] >= 1, "no worker fenced itself through the store outage"
    assert summary["broker_outages"] == 1
    assert summary["container_restarts"] >= 1, "no restart in a new PID namespace"
    assert summary["partitions"] == 1 and summary["partition_seconds"] > 6


def _line(effect: str, epoch: int, pid: int, ts: float) -> dict[str, object]:
    return {"effect": effect, "key": "k", "epoch": epoch, "pid": pid, "ts": ts}


def test_overlap_check_tells_a_refused_write_from_a_running_execution() -> None:
    """The soak's invariant 7 on hand-made effect lines (no services)."""
    after_refusal = [_line("start", 1, 10, 0.0), _line("row", 1, 10, 1.0),
                     _line("start", 2, 20, 2.0), _line("refused", 1, 10, 2.5),
                     _line("end", 2, 20, 3.0)]
    assert overlaps("k", after_refusal) == ([], 1)

    effect_after_takeover = [_line("start", 1, 10, 0.0), _line("start", 2, 20, 2.0),
                             _line("row", 1, 10, 2.5), _line("refused", 1, 10, 2.6)]
    found, refused = overlaps("k", effect_after_takeover)
    assert refused == 1 and len(found) == 1 and "token 1 (pid 10) wrote 'row'" in found[0]

    one_token_two_pids = [_line("start", 1, 10, 0.0), _line("end", 1, 11, 1.0)]
    assert "ran in 2 processes" in overlaps("k", one_token_two_pids)[0][0]


def _telling(out: str) -> str:
    """The output's tail, and any stack dump of an overstaying deploy (it comes earlier)."""
    dumps = [block for block in out.split("[chaos ") if "its log after SIGUSR1" in block]
    return "".join(f"[chaos {block}" for block in dumps)[-20000:] + "\n...\n" + out[-6000:]
