"""pytest fixtures: real processes for resilience tests, an isolated store for unit tests.

Enable with ``pytest_plugins = ["celery_resilient.testing.plugin"]``. Every node a test
starts through ``resilient_nodes`` is SIGKILLed at teardown, so no process outlives it;
``resilient_store`` gives each test a store of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery._state import _get_active_apps

from celery_resilient.runtime.runtime import Runtime
from celery_resilient.testing.effects import EffectLog
from celery_resilient.testing.nodes import LocalBeat, LocalWorker
from celery_resilient.testing.stores import table_prefix, use_store


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


class IsolatedStore:
    """A store of one test's own: a fresh SQLite file, used by the apps it is applied to."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self._undo: list[Any] = []
        self._applied: list[Celery] = []
        self._migrated: set[str] = set()

    def apply(self, app: Celery) -> Runtime:
        """Point ``app`` (with ``Resilient`` applied) at this store until the test ends."""
        if not any(a is app for a in self._applied):
            prefix = table_prefix(app)
            self._undo.append(use_store(app, self.url, migrate=prefix not in self._migrated))
            self._migrated.add(prefix)
            self._applied.append(app)
        return Runtime.of(app)

    @property
    def apps(self) -> list[Celery]:
        return list(self._applied)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()
        self._applied.clear()


@pytest.fixture
def resilient_store(tmp_path: Path) -> Iterator[IsolatedStore]:
    """A fresh store for this test, applied to every live Celery app with ``Resilient``.

    Eager tasks, ``.apply()`` and ``self.ledger`` then write into an SQLite file under
    ``tmp_path`` (schema created), so two tests using the same task id never see each
    other's work; the apps get their previous store back at teardown. Apply it to an app
    created later with ``resilient_store.apply(app)``.
    """
    isolated = IsolatedStore(tmp_path / "resilient-store.sqlite3")
    try:
        for app in list(_get_active_apps()):
            if Runtime.enabled_on(app) is not None:
                isolated.apply(app)
        yield isolated
    finally:
        isolated.restore()
