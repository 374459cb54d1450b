"""A celery process run locally in its own process group, shaped like a pytest-celery container.

pytest-celery's nodes drive Docker containers; there is no Docker engine where resilience
tests run, and SIGKILL of a real process group is the point. ``LocalProcess`` offers the
container methods the nodes call (``ready``, ``logs``, ``kill``, ``restart``, ``teardown``...).
"""

from __future__ import annotations

import os
import signal as signals
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from celery_resilient.testing.waiting import wait_for

_SIGNALS = {name: getattr(signals, name) for name in dir(signals) if name.startswith("SIG")}


def _children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


class LocalProcess:
    """``python -m celery <argv>`` with its log captured to a file; restartable."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: str | os.PathLike[str],
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 ready_prompt: str = "ready.", ready_timeout: float = 60.0,
                 wrapper: Sequence[str] = ()) -> None:
        self.name = name
        self.argv = list(argv)
        #: A command the process runs under, e.g. ``("unshare", "--pid", "--fork",
        #: "--mount-proc")``: a PID namespace of its own at each start, as a container has.
        self.wrapper = list(wrapper)
        self.env = {**os.environ, **(env or {})}
        self.cwd = str(cwd) if cwd else None
        self.ready_prompt = ready_prompt
        self.ready_timeout = ready_timeout
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.celeryconfig: dict[str, object] = {}

    # -- container-shaped API ---------------------------------------------------------------

    @property
    def id(self) -> str:
        return f"{self.name}-{self.pid or 0}".ljust(12, "0")

    @property
    def status(self) -> str:
        return "running" if self.proc is not None and self.proc.poll() is None else "exited"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.{self.starts}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, wait: bool = True) -> LocalProcess:
        if self.status == "running":
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.starts += 1
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "celery", *self.argv], stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env, cwd=self.cwd, start_new_session=True,  # own process group
        )
        log.close()
        if wait:
            self.ready()
        return self

    def ready(self) -> bool:
        def is_ready() -> bool:
            if self.status != "running":
                raise RuntimeError(f"{self.name} exited during start:\n{self.logs()[-4000:]}")
            return self.ready_prompt in self.logs()

        wait_for(is_ready, self.ready_timeout, f"{self.name} to log {self.ready_prompt!r}")
        return True

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def all_logs(self) -> str:
        return "".join(
            (self.log_dir / f"{self.name}.{n}.log").read_text(errors="replace")
            for n in range(1, self.starts + 1)
            if (self.log_dir / f"{self.name}.{n}.log").exists()
        )

    def kill(self, signal: str | int = "SIGKILL", group: bool = True) -> None:
        """Send ``signal`` to the whole process group (main process and pool children)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        sig = _SIGNALS[signal] if isinstance(signal, str) else signal
        if group:
            os.killpg(self.proc.pid, sig)
        else:  # the celery main process itself, even under a forking wrapper
            os.kill(self.main_pid or self.proc.pid, sig)
        if sig == signals.SIGKILL:
            self.proc.wait(timeout=30)
            self._reap_group()

    def reload(self) -> None:
        """Container API parity: nothing to refresh for a local process."""

    def restart(self, timeout: float | None = None) -> None:
        self.stop(timeout or 30)
        self.start()

    def stop(self, timeout: float = 30) -> None:
        """Graceful stop (SIGTERM, warm shutdown), SIGKILL if it overstays ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signals.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill("SIGKILL")
        self._reap_group()

    def teardown(self) -> None:
        self.kill("SIGKILL")

    @property
    def main_pid(self) -> int | None:
        """The celery main process: the started process, or, under a wrapper that forks
        (``unshare --fork``), its child."""
        if self.pid is None or "--fork" not in self.wrapper:
            return self.pid
        forked = _children_of(self.pid)
        return forked[0] if forked else None

    def children(self) -> list[int]:
        """PIDs of the celery main process's direct children (the prefork pool)."""
        main = self.main_pid
        return _children_of(main) if main is not None else []

    def _reap_group(self) -> None:
        """Wait until no process of the group is left (pool children die with PDEATHSIG)."""
        pgid = self.proc.pid if self.proc else None
        if pgid is None:
            return

        def group_gone() -> bool:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            try:
                os.killpg(pgid, signals.SIGKILL)
            except ProcessLookupError:
                return True
            time.sleep(0.05)
            return False

        wait_for(group_gone, 30, f"process group {pgid} to exit")
