"""pytest-celery nodes backed by local processes: a worker and a beat you can SIGKILL."""

from __future__ import annotations

import os
import signal as signals
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import celery
from celery import Celery
from pytest_celery import CeleryTestNode, CeleryTestWorker

from celery_resilient.testing.process import LocalProcess
from celery_resilient.testing.waiting import wait_for


class _LocalNode:
    """What worker and beat nodes share: a LocalProcess in place of a container."""

    container: LocalProcess

    @property
    def process(self) -> LocalProcess:
        return self.container

    def kill(self, signal: str | int = "SIGKILL", reload_container: bool = True) -> None:
        self.process.kill(signal)

    def restart(self, reload_container: bool = True, force: bool = False) -> None:
        """Start again after a kill, or stop gracefully and start when it still runs."""
        if self.process.status == "running":
            self.process.stop()
        self.process.start()


class LocalWorker(_LocalNode, CeleryTestWorker):  # type: ignore[misc]
    """A ``celery worker`` (prefork by default) in its own process group."""

    def __init__(self, app_module: str, log_dir: str | os.PathLike[str], *,
                 name: str = "worker", concurrency: int = 1, pool: str = "prefork",
                 queues: Sequence[str] = ("celery",), extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 app: Celery | None = None, loglevel: str = "INFO",
                 wrapper: Sequence[str] = (), node_name: str | None = None) -> None:
        self.node_name = node_name or f"{name}@%h"
        argv = ["-A", app_module, "worker", "-n", self.node_name, "-c", str(concurrency),
                "-P", pool, "-Q", ",".join(queues), "-l", loglevel, "--without-gossip",
                "--without-mingle", *extra_args]
        process = LocalProcess(name, argv, log_dir, env=env, cwd=cwd, ready_prompt="ready.",
                               wrapper=wrapper)
        super().__init__(process, app)
        self._queues = list(queues)
        self._loglevel = loglevel

    @property
    def version(self) -> str:
        return str(celery.__version__)

    @property
    def log_level(self) -> str:
        return self._loglevel

    @property
    def worker_name(self) -> str:
        return self.process.name

    @property
    def worker_queue(self) -> str:
        return self._queues[0]

    def hostname(self) -> str:
        return self.node_name.replace("%h", socket.gethostname())

    def start(self) -> LocalWorker:
        self.process.start()
        return self

    def pool_pids(self, expected: int = 1, timeout: float = 30) -> list[int]:
        return wait_for(lambda: self.process.children() if len(self.process.children()) >= expected
                        else [], timeout, f"{expected} pool process(es) of {self.worker_name}")

    def kill_pool_child(self, pid: int | None = None) -> int:
        """SIGKILL one pool process only; the main process survives and sees WorkerLostError."""
        target = pid or self.pool_pids()[0]
        os.kill(target, signals.SIGKILL)
        return target



class LocalBeat(_LocalNode, CeleryTestNode):  # type: ignore[misc]
    """A ``celery beat`` process (for example with the ResilientScheduler)."""

    def __init__(self, app_module: str, log_dir: str | os.PathLike[str], *, name: str = "beat",
                 scheduler: str | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 app: Celery | None = None, loglevel: str = "INFO",
                 ready_prompt: str = "beat: Starting...") -> None:
        argv = ["-A", app_module, "beat", "-l", loglevel, *extra_args]
        if scheduler:
            argv += ["-S", scheduler]
        process = LocalProcess(name, argv, log_dir, env=env, cwd=cwd, ready_prompt=ready_prompt)
        super().__init__(process, app)

    def start(self) -> LocalBeat:
        self.process.start()
        return self

    def hostname(self) -> str:
        return self.process.name


def describe(node: Any) -> str:
    return f"{type(node).__name__}({node.process.name}, pid={node.process.pid})"
