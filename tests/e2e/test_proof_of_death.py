"""Proof of death across PID namespaces and hosts: a worker SIGKILLed mid-task and restarted
in a PID namespace of its own (``unshare --pid --fork --mount-proc``, as a container restart
is), or under another host name (``--uts``: a pod rescheduled elsewhere keeps its node name),
library defaults. ``/proc`` cannot prove the predecessor dead from another host; its
liveness session can (PostgreSQL's advisory lock, MariaDB's named lock: each test runs on
both stores): the killed task and the prefetched ones run again within 2 s of the restart,
the killed one from its checkpoint (before: 29 s, the lease)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import pytest

from celery_resilient.core import codec
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker

from .conftest import Project

PID_NS = ("unshare", "--pid", "--fork", "--mount-proc")
ROWS, DELAY = 12, 0.25
AGAIN_WITHIN = 2.0


@pytest.fixture(params=["postgresql", "mariadb"])
def project(request: pytest.FixtureRequest, make_project: Callable[..., Project],
            broker_url: str, pg_url: str, mysql_url: str) -> Project:
    """A project on each store with a liveness session (MariaDB's tables are dropped after
    the test by ``table_prefix``)."""
    return make_project(broker_url, pg_url if request.param == "postgresql" else mysql_url)


def _on_host(name: str) -> list[str]:
    """Run under host name ``name`` in UTS and PID namespaces of its own."""
    return ["unshare", "--uts", *PID_NS[1:], "sh", "-c", 'hostname "$0" && exec "$@"', name]


def _checkpointed(project: Project, key: str) -> int:
    found = project.store.load_checkpoint(key)
    return 0 if found is None else int(codec.decode(found[0])["row"])


def _ready_at(log: str) -> float:
    line = next(ln for ln in log.splitlines() if ln.endswith(" ready."))
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _kill_and_restart(project: Project, effects: EffectLog, worker: LocalWorker,
                      wrapper: list[str] | tuple[str, ...]) -> str:
    """SIGKILL ``worker`` mid-task with 3 prefetched, restart it under ``wrapper``; check all
    ran again within AGAIN_WITHIN of the restart; return the restart's log."""
    assert "liveness=session" in worker.process.logs()
    key = project.send("ingest", ROWS, DELAY)
    shorts = [project.send("short", n) for n in range(3)]
    wait_for(lambda: _checkpointed(project, key) >= 5, 30, "5 checkpointed rows")
    worker.kill("SIGKILL")  # the whole group: unshare, the worker and its pool
    saved = _checkpointed(project, key)
    worker.process.wrapper = list(wrapper)
    worker.restart()
    log = worker.process.logs()
    ready = _ready_at(log)
    wait_for(lambda: project.all_done([key, *shorts]), 60, "the work to finish")
    starts = effects.entries(f"start:{key}")
    assert len(starts) == 2 and starts[1]["row"] == saved, "not resumed from its checkpoint"
    assert starts[1]["ts"] - ready <= AGAIN_WITHIN, f"ran again {starts[1]['ts'] - ready:.1f}s " \
        "after the restart"
    for short in shorts:  # prefetched: they run after the killed task (-c 1)
        ran = effects.entries(f"short:{short}")
        assert ran and ran[-1]["ts"] - ready <= AGAIN_WITHIN + ROWS * DELAY + 2, short
    assert "ANOTHER LIVE WORKER" not in log and "CANNOT TELL" not in log
    return log


def test_a_restart_in_another_pid_namespace_takes_its_work_back_at_once(
        project: Project, effect_log: EffectLog) -> None:
    worker = project.worker(concurrency=1, wrapper=PID_NS)
    log = _kill_and_restart(project, effect_log, worker, PID_NS)
    assert "earlier start of worker@" in log and "is gone" in log, log[-3000:]


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_restart_on_another_host_is_proven_by_its_session(
        project: Project, effect_log: EffectLog) -> None:
    """The same node name on another host name: only the ended session can prove it."""
    worker = project.worker(concurrency=1, wrapper=_on_host("host-a"), node_name="pod@pod-0")
    log = _kill_and_restart(project, effect_log, worker, _on_host("host-b"))
    assert "on host-a) is gone: its database session has ended" in log, log[-3000:]


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_a_live_namesake_is_told_apart(project: Project) -> None:
    """Two live workers under one node name on two host names: the second's start finds the
    first's session alive and says so (it cannot be a dead predecessor)."""
    first = project.worker(name="a", wrapper=_on_host("host-a"), node_name="twin@pod-0")
    second = project.worker(name="b", wrapper=_on_host("host-b"), node_name="twin@pod-0")
    log = second.process.logs()
    assert "ANOTHER LIVE WORKER USES THE NODE NAME twin@pod-0" in log, log[-3000:]
    assert "session is alive" in log
    assert first.process.status == "running"
