"""Canvas under random SIGKILLs and deploys at CI size (``benchmarks/canvas_chaos.py``):
chords, chains, groups of chains, chains ending in a chord and chords whose header fails, on
3 workers SIGKILLed 8 times (whole worker or one pool process) and deployed 4 times (SIGTERM
to the main process, as a deploy does: the warm shutdown must end within 30 s), Redis broker
and backend with their defaults, no durable submit. Nothing may hang, end wrong or run
twice. Once with a PostgreSQL store, once with a MariaDB store (the machine's servers). The
full run, with plain Celery as the baseline in its output, is the documented command in
docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.chaos


@pytest.mark.parametrize("store", ["postgresql", "mariadb"])
@pytest.mark.timeout(430)
# Redis database 14 and the worker names cc0-cc2 are the run's: one run at a time.
@pytest.mark.xdist_group("canvas-chaos")
def test_canvas_chaos_small(store: str) -> None:
    argv = [sys.executable, str(ROOT / "benchmarks" / "canvas_chaos.py"), "--modes",
            "resumable", "--seeds", "5", "--kills", "8", "--deploys", "4", "--scale", "1",
            "--deadline", "90", "--store", store]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400,
                          check=False)
    out = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("CANVAS-SUMMARY ")]
    assert done.returncode == 0 and lines, out[-6000:]
    summary = json.loads(lines[-1].split(" ", 1)[1])
    assert summary["store"] == store
    assert summary["kills_group"] + summary["kills_child"] == 8
    assert summary["deploys"] == 4 and summary["deploys_mid_canvas"] >= 1, summary
    assert summary.get("deploys_slow", 0) == 0, summary["deploy_exit_seconds"]
    assert summary["hung"] == 0 and summary["wrong"] == 0, summary["table"]
    assert summary["chord_body_twice"] == 0, summary
    assert summary["errback_lost"] == 0 and summary["errback_twice"] == 0, summary
    assert sum(kind["sent"] for kind in summary["table"].values()) == 9
