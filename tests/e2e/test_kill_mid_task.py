"""The brutal path: SIGKILL mid-task, restart, nothing lost and nothing applied twice."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from celery_resilient.core import codec, messages
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.services import drop_prefixed_tables

from .conftest import Project

ROWS = 20
DELAY = 0.15


def _checkpointed(project: Project, key: str) -> int:
    """Rows durably checkpointed so far (the store's view, not the effect log's)."""
    found = project.store.load_checkpoint(key)
    return 0 if found is None else int(codec.decode(found[0])["row"])


def _assert_resumed_exactly(effects: EffectLog, key: str) -> int:
    """Rows before the resume point ran once; the run resumed at its checkpoint, not 0."""
    starts = [e for e in effects.entries() if e["effect"] == f"start:{key}"]
    assert len(starts) == 2, f"expected one start and one resume, got {starts}"
    resumed_at = starts[1]["row"]
    assert resumed_at > 0, "the second execution started from zero"
    counts = effects.counts()
    for i in range(ROWS):
        times = counts[f"row:{key}:{i}"]
        # The row in flight when the process died (checkpointed next) may be seen twice:
        # its effect is outside the store. Every other row exactly once.
        if i == resumed_at:
            assert times in (1, 2), f"row {i} ran {times} times"
        else:
            assert times == 1, f"row {i} ran {times} times"
    assert counts[f"notify:{key}"] == 1, "step effect not applied exactly once"
    assert counts[f"charge:{key}"] == 1, "ledger effect not applied exactly once"
    return int(resumed_at)


def _redeliver_finished(project: Project, key: str) -> None:
    """Send the finished message again, byte for byte: it must run nothing."""
    message = project.store.get_message(key)
    assert message is not None
    with project.client.connection_for_write() as conn:
        messages.publish(conn, message, {})


def test_sigkill_whole_worker_mid_task_resumes_from_checkpoint(project: Project,
                                                               effect_log: EffectLog) -> None:
    worker = project.worker()
    key = project.send("ingest", ROWS, DELAY, task_id="ingest-1")
    wait_for(lambda: _checkpointed(project, key) >= 5, 30, "5 checkpointed rows")
    worker.kill("SIGKILL")  # the whole process group: main process and pool child
    killed_at = time.monotonic()
    saved = _checkpointed(project, key)
    assert project.state(key) == "running"

    worker.restart()
    wait_for(lambda: project.state(key) == "done", 60, "the work to finish after restart")
    resumed_at = _assert_resumed_exactly(effect_log, key)
    assert resumed_at == saved, "did not resume from the last durable checkpoint"
    row = project.store.get_work(key)
    # One death was counted at the takeover; the resumed run's checkpoint progress then reset
    # the crash-loop counter (tests/integration/test_crash_loop.py).
    assert row is not None and row.epoch == 2 and row.attempts == 2 and row.deaths == 0
    assert codec.decode(row.result_json) == {"rows": ROWS, "notify": "sent",
                                             "charge": f"receipt-{key}"}
    print(f"resumed from row {resumed_at}; finished {time.monotonic() - killed_at:.1f}s "
          "after the kill")

    before = effect_log.counts()
    _redeliver_finished(project, key)
    wait_for(lambda: "already done" in worker.process.logs(), 30,
             "the redelivered finished message to be skipped")
    assert effect_log.counts() == before


def test_sigkill_pool_child_only_resumes(project: Project, effect_log: EffectLog) -> None:
    worker = project.worker()
    key = project.send("ingest", ROWS, DELAY, task_id="ingest-child")
    wait_for(lambda: _checkpointed(project, key) >= 5, 30, "5 checkpointed rows")
    worker.kill_pool_child()  # main process lives: WorkerLostError, reject + requeue
    wait_for(lambda: project.state(key) == "done", 60, "the work to finish after the child died")
    resumed_at = _assert_resumed_exactly(effect_log, key)
    assert resumed_at >= 5
    assert worker.process.status == "running"
    assert re.search(r"resuming work ingest-child", worker.process.logs())


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_sqlite_store_survives_sigkill(make_project, broker_url: str, tmp_path,  # type: ignore[no-untyped-def]
                                       effect_log: EffectLog) -> None:
    """The embedded default (SQLite file) keeps checkpoints across a SIGKILL too."""
    project = make_project(broker_url, f"sqlite:///{tmp_path}/store.sqlite3")
    worker = project.worker(concurrency=2)
    key = project.send("ingest", ROWS, DELAY, task_id="ingest-sqlite")
    wait_for(lambda: _checkpointed(project, key) >= 5, 30, "5 checkpointed rows")
    worker.kill("SIGKILL")
    saved = _checkpointed(project, key)
    worker.restart()
    wait_for(lambda: project.state(key) == "done", 60, "the work to finish after restart")
    assert _assert_resumed_exactly(effect_log, key) == saved


@pytest.fixture
def mariadb_project(make_project, broker_url: str, mysql_url: str,  # type: ignore[no-untyped-def]
                    table_prefix: str) -> Iterator[Project]:
    """A project whose store is MariaDB (its tables dropped after the test)."""
    project = make_project(broker_url, mysql_url)
    yield project
    project.close()
    drop_prefixed_tables(mysql_url, table_prefix)


def test_mariadb_store_survives_sigkill(mariadb_project: Project,
                                        effect_log: EffectLog) -> None:
    """On a MariaDB store: a whole-worker SIGKILL mid-task, a restart that resumes from the
    last durable checkpoint (the takeover proven by the dead worker's ended session, or its
    lease), steps and the ledger applied once, and a redelivered finished message that runs
    nothing."""
    project = mariadb_project
    worker = project.worker(concurrency=2)
    key = project.send("ingest", ROWS, DELAY, task_id="ingest-mariadb")
    wait_for(lambda: _checkpointed(project, key) >= 5, 30, "5 checkpointed rows")
    logs = worker.process.logs()
    assert "liveness=session" in logs and "batched_takes=on" in logs, logs[-3000:]
    worker.kill("SIGKILL")
    saved = _checkpointed(project, key)
    assert project.state(key) == "running"
    worker.restart()
    wait_for(lambda: project.state(key) == "done", 60, "the work to finish after restart")
    assert _assert_resumed_exactly(effect_log, key) == saved
    row = project.store.get_work(key)
    assert row is not None and row.epoch == 2 and row.attempts == 2 and row.deaths == 0
    assert codec.decode(row.result_json) == {"rows": ROWS, "notify": "sent",
                                             "charge": f"receipt-{key}"}
    before = effect_log.counts()
    _redeliver_finished(project, key)
    wait_for(lambda: "already done" in worker.process.logs(), 30,
             "the redelivered finished message to be skipped")
    assert effect_log.counts() == before
