"""pytest fixtures for resilience tests with real processes.

Enable with ``pytest_plugins = ["celery_resilient.testing.plugin"]``. Every node a test
starts through ``resilient_nodes`` is SIGKILLed at teardown, so no process outlives it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .effects import EffectLog
from .nodes import LocalBeat, LocalWorker


class NodeFactory:
    """Builds local worker and beat nodes that share one log directory and environment."""

    def __init__(self, log_dir: Path, env: dict[str, str], cwd: str | None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.cwd = cwd
        self.started: list[LocalWorker | LocalBeat] = []

    def worker(self, app_module: str, *, start: bool = True, **kwargs: Any) -> LocalWorker:
        env = {**self.env, **kwargs.pop("env", {})}
        node = LocalWorker(app_module, self.log_dir, env=env, cwd=kwargs.pop("cwd", self.cwd),
                           **kwargs)
        self.started.append(node)
        return node.start() if start else node

    def beat(self, app_module: str, *, start: bool = True, **kwargs: Any) -> LocalBeat:
        env = {**self.env, **kwargs.pop("env", {})}
        node = LocalBeat(app_module, self.log_dir, env=env, cwd=kwargs.pop("cwd", self.cwd),
                         **kwargs)
        self.started.append(node)
        return node.start() if start else node

    def teardown(self) -> None:
        for node in self.started:
            node.process.teardown()


@pytest.fixture
def effect_log(tmp_path: Path) -> EffectLog:
    """An empty effect log; pass ``effect_log.path`` to the processes under test."""
    return EffectLog(tmp_path / "effects.jsonl")


@pytest.fixture
def resilient_nodes(tmp_path: Path, effect_log: EffectLog,
                    request: pytest.FixtureRequest) -> Iterator[NodeFactory]:
    """Start worker/beat processes; all are killed at teardown, their logs kept on failure."""
    env = {"RESILIENT_EFFECT_LOG": str(effect_log.path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(request.config.rootpath),
                                                       os.environ.get("PYTHONPATH")]))}
    factory = NodeFactory(tmp_path / "logs", env, None)
    yield factory
    factory.teardown()
