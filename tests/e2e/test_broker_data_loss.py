"""A Redis broker restarted empty (no persistence) while durably submitted work was queued:
the store re-sends what the broker lost within one sweep of the broker answering again, not
a submit timeout later, and every unit ends once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis

from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.services import ThrowawayRedis

from . import proj
from .conftest import Project

pytestmark = pytest.mark.e2e

TASKS = 50
ROWS, DELAY = 4, 0.25  # about a second each: most of the 50 are still queued at the wipe
#: What the issue asks of the re-send: within 10 s of the broker answering again (the default
#: sweep runs every 5 s; resilient_submit_timeout, the hold it used to wait for, is 60 s).
RESEND_WITHIN = 10.0


def _waiting_for_the_broker(project: Project, keys: list[str]) -> list[str]:
    """Submissions still held for a broker copy that was never re-sent."""
    waiting = []
    for key in keys:
        row = project.store.get_work(key)
        if row is not None and row.state == "requeued" and row.republished == 0:
            waiting.append(key)
    return waiting


def _started(effects: EffectLog) -> int:
    return sum(n for name, n in effects.counts().items() if name.startswith("start:"))


def test_a_broker_restarted_empty_gets_its_queued_work_back_within_a_sweep(
        make_project: Callable[..., Project], effect_log: EffectLog) -> None:
    server = ThrowawayRedis(persistent=False).start()
    try:
        project = make_project(server.url)
        project.extra = {"resilient_durable_submit": True}  # the library's defaults otherwise
        env = {**project.env(), "RESILIENT_EFFECT_LOG": str(effect_log.path)}
        workers = [project.worker(name=f"w{i}", concurrency=2) for i in range(2)]
        client = proj.create_app(env)
        sent = [client.tasks["tests.e2e.proj.ingest"].apply_async(
            (ROWS, DELAY), task_id=f"lossy-{n}", queue=project.queue).id for n in range(TASKS)]
        queue = redis.Redis.from_url(server.url)
        wait_for(lambda: _started(effect_log) >= 4, 30, "four jobs running")
        queued = queue.llen(project.queue)
        assert queued >= 10, f"only {queued} left queued: the wipe would prove nothing"
        server.restart()  # SIGKILL and a new empty server on the same port
        answered = time.monotonic()
        assert queue.llen(project.queue) == 0, "the restarted broker kept its queue"

        wait_for(lambda: not _waiting_for_the_broker(project, sent), RESEND_WITHIN,
                 f"every lost submission re-sent within {RESEND_WITHIN:g}s of the broker "
                 "answering")
        resent_after = time.monotonic() - answered
        wait_for(lambda: project.all_done(sent), 90, "all 50 to end")
        counts = effect_log.counts()
        for key in sent:
            assert counts[f"start:{key}"] == 1, f"{key} started {counts[f'start:{key}']} times"
            assert all(counts[f"row:{key}:{i}"] == 1 for i in range(ROWS)), key
            assert counts[f"charge:{key}"] == 1 and counts[f"notify:{key}"] == 1, key
        logs = "".join(w.process.logs() for w in workers)
        assert "the broker lost its data" in logs
        print(f"{queued} queued at the wipe; every lost one re-sent {resent_after:.1f}s after "
              "the broker answered")
        client.close()
    finally:
        server.destroy()
