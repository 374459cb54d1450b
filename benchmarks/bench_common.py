"""Shared helpers for the benchmarks: worker processes, waiting, statistics, markdown tables."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from celery_resilient.testing.waiting import wait_for as _wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str,
             interval: float = 0.005) -> T:
    """The library's wait with a deadline, polling fast (drain detection times the run)."""
    return _wait_for(condition, timeout, what, interval)


class Worker:
    """A real ``celery worker`` (prefork) in its own process group, log in a file."""

    def __init__(self, name: str, env: Mapping[str, str], queue: str, log_dir: Path, *,
                 concurrency: int = 2, app: str = "bench_app") -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        pythonpath = os.pathsep.join(filter(None, [str(HERE), str(ROOT),
                                                   os.environ.get("PYTHONPATH")]))
        self.argv = [sys.executable, "-m", "celery", "-A", app, "worker", "-n",
                     f"{name}@%h", "-c", str(concurrency), "-P", "prefork", "-Q", queue,
                     "-l", "WARNING", "--without-gossip", "--without-mingle",
                     "--without-heartbeat"]
        self.env = {**os.environ, **env, "PYTHONPATH": pythonpath}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=ROOT, start_new_session=True)
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        if self.proc is None:
            return []
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except FileNotFoundError:
            kids = ""
        return [self.proc.pid, *(int(p) for p in kids.split())]

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_cpu() -> float:
    """CPU seconds every CPU of the machine has spent busy (not idle or iowait) so far;
    steal (time the hypervisor gave another guest) is not this machine's work."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:7]) - idle) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    ordered = sorted(values)
    rank = max(1, round(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, "
            f"Python {platform.python_version()}")
