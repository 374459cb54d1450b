"""The chaos soak at CI size: 300 tasks, 3 workers, 10 SIGKILLs, one Redis and one PostgreSQL
restart (throwaway servers of the run's own), every invariant checked (``benchmarks/chaos.py``).

``--visibility-timeout 20``: a message a worker fetched while the store was down, whose
receipt could not be written before the worker was SIGKILLed, is covered only by the broker's
own redelivery (Redis: the visibility timeout, 1 hour by default). The soak found this window;
see docs/reliability.md. Every other path is the library's own recovery.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.chaos


@pytest.mark.timeout(330)
def test_chaos_small() -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--tasks", "300",
            "--workers", "3", "--kills", "10", "--seconds", "240", "--visibility-timeout", "20"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    out = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("CHAOS-SUMMARY ")]
    assert lines, out[-6000:]
    summary = json.loads(lines[-1].split(" ", 1)[1])
    assert done.returncode == 0, f"invariants violated:\n{out[-6000:]}"
    assert summary["violations"] == []
    assert summary["tasks"] == 300
    assert summary["kills_group"] + summary["kills_child"] == 10
    assert summary["kills_mid_task"] >= 3, "the kills hit no running work: the soak proved little"
    assert summary["redis_restarts"] == 1 and summary["pg_restarts"] == 1
    assert summary["resumed_long"] >= 1, "no long task was resumed from a checkpoint"
