"""Links that stay open and answer nothing (a paused pooler, a stalled proxy, a server frozen
on its disk), library defaults (lease 30 s, Redis's visibility timeout): one worker's link
goes through ``celery_resilient.testing.silent_link.SilentLink``, which keeps every socket
connected and forwards nothing, so TCP never gives up on it; another worker is direct.

- **Store link silent** for longer than the lease, while the worker runs a task that makes an
  effect outside the store every row and checkpoints every 20 s (sparse) and one that
  checkpoints every row (dense, so it is stuck in its write): the silent worker stops both
  executions (self-fencing) before the other worker takes them over, measured on the pool
  processes' deaths, not only on their effects; each finishes once, its step once; the
  silent worker serves again by itself once the link answers.
- **Broker link silent** for longer than the lease: the running task finishes (the store
  answers); the prefetched ones run on the other worker; nothing runs twice; the silent
  worker consumes again by itself once the link answers.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import pytest
from sqlalchemy.engine import make_url

from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.silent_link import SilentLink

from .conftest import Project

LEASE = 30.0  # the library's default
FENCED = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): ERROR/MainProcess\] fenced: "
                    r"stopped pool process \d+ running \S+\[([0-9a-f-]+)\]")


def _starts(effects: EffectLog, key: str) -> dict[int, float]:
    """The first effect of each execution (fencing token) of ``key``."""
    first: dict[int, float] = {}
    for e in effects.entries():
        if e["effect"].startswith(("start:", "row:")) and key in e["effect"]:
            first.setdefault(int(e["epoch"]), float(e["ts"]))
    return first


def _spans(effects: EffectLog, key: str) -> list[tuple[float, float]]:
    spans: dict[int, list[float]] = {}
    for e in effects.entries():
        if e["effect"].startswith(("start:", "row:", "end:")) and key in e["effect"]:
            spans.setdefault(int(e["epoch"]), []).append(float(e["ts"]))
    return [(min(ts), max(ts)) for _, ts in sorted(spans.items())]


def _fenced_at(worker: LocalWorker) -> dict[str, float]:
    """When the worker stopped each task's pool process (its log's clock is this host's)."""
    stopped: dict[str, float] = {}
    for stamp, task_id in FENCED.findall(worker.process.logs()):
        at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        stopped.setdefault(task_id, at)
    return stopped


@pytest.fixture
def store_link(pg_url: str) -> Iterator[SilentLink]:
    url = make_url(pg_url)
    link = SilentLink(url.host or "127.0.0.1", url.port or 5432)
    yield link
    link.close()


@pytest.mark.parametrize("shape", ["all-silent", "pooler-paused"])
def test_a_worker_whose_store_goes_silent_fences_before_a_takeover(
        make_project: Callable[..., Project], redis_url: str, pg_url: str,
        store_link: SilentLink, effect_log: EffectLog, shape: str) -> None:
    """``all-silent``: every store connection goes through the link (a frozen server); the
    liveness session falls silent too and fences first. ``pooler-paused``: the store URL
    goes through the link and the liveness session is direct (``resilient_liveness_url``,
    as behind PgBouncer): only the lease can fence."""
    project = make_project(redis_url)
    silent_url = make_url(pg_url).set(host="127.0.0.1", port=store_link.port)
    if shape == "pooler-paused":
        project.extra["resilient_liveness_url"] = pg_url
    silent = project.worker(name="silent", concurrency=2, env={
        "RESILIENT_STORE_URL": silent_url.render_as_string(hide_password=False)})
    project.extra.pop("resilient_liveness_url", None)
    sparse = project.send("sparse", 120, 0.5, 40)  # a checkpoint every 20 s
    dense = project.send("ingest", 240, 0.25)  # a checkpoint every row
    wait_for(lambda: effect_log.count(f"row:{sparse}:4") == 1
             and effect_log.count(f"row:{dense}:8") == 1, 60, "the silent worker to run both")
    other = project.worker(name="other", concurrency=2)
    silenced_at = time.time()
    store_link.silence()
    wait_for(lambda: len(_fenced_at(silent)) >= 2, LEASE + 5,
             "the silent worker to stop both executions")
    wait_for(lambda: all(len(_starts(effect_log, k)) >= 2 for k in (sparse, dense)),
             LEASE + 30, "the other worker to take both over")
    wait_for(lambda: time.time() >= silenced_at + LEASE + 10, LEASE + 20,
             "the silence to outlast the lease")
    store_link.resume()
    wait_for(lambda: project.all_done([sparse, dense]), 180, "the work to finish")

    fenced = _fenced_at(silent)
    for key in (sparse, dense):
        starts = sorted(_starts(effect_log, key).items())
        successor = starts[1][1]
        stopped = fenced[key]
        # the zombie gone before the takeover: its pool process died before the successor
        # made its first effect (a log's milliseconds against the effect log's clock)
        assert stopped < successor, f"{key}: stopped {stopped - successor:+.2f}s after " \
                                    "its successor started"
        spans = _spans(effect_log, key)
        gaps = [later[0] - earlier[1] for earlier, later in itertools.pairwise(spans)]
        assert all(g > 0 for g in gaps), f"executions of {key} overlapped: gaps {gaps}"
        print(f"{shape} {key}: fenced {stopped - silenced_at:.1f}s into the silence, "
              f"{successor - stopped:.1f}s before its successor started")
    reason = "lease" if shape == "pooler-paused" else "session"
    assert f"SELF-FENCING ({reason})" in silent.process.logs()
    assert effect_log.count(f"notify:{sparse}") == 1, "the sparse task's step ran twice"
    assert effect_log.count(f"end:{sparse}") == 1
    assert effect_log.count(f"notify:{dense}") == 1, "the dense task's step ran twice"
    assert effect_log.count(f"charge:{dense}") == 1, "the dense task's ledger effect twice"
    # the silent worker rejoins by itself: its lease renewed, its fence lifted, it serves
    wait_for(lambda: "fence lifted" in silent.process.logs(), 60, "the worker to rejoin")
    other.process.stop()
    again = [project.send("short", n) for n in range(4)]
    wait_for(lambda: project.all_done(again), 60, "the once-silent worker to serve again")
    assert silent.process.status == "running"


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_worker_whose_store_goes_silent_exits_before_a_takeover(
        make_project: Callable[..., Project], redis_url: str, pg_url: str,
        store_link: SilentLink, effect_log: EffectLog, pool: str) -> None:
    """A pool without child processes is fenced by ending the worker. Two things failed on
    the green pools: the fence took Celery's worker pid of a green thread (its ``id()``) for
    a process to SIGKILL, failed, and stopped nothing; and on eventlet psycopg waited in C,
    so the first statement on the silent link stopped the lease renewal, the deadline
    watchdog and the fencing guard with it until the link answered."""
    if importlib.util.find_spec(pool) is None:  # (never imported here: eventlet's import
        pytest.skip(f"{pool} is not installed")  # warns at every later fork of this process)
    project = make_project(redis_url)
    silent_url = make_url(pg_url).set(host="127.0.0.1", port=store_link.port)
    silent = project.worker(name="silent", concurrency=4, pool=pool, env={
        "RESILIENT_STORE_URL": silent_url.render_as_string(hide_password=False)})
    sparse = project.send("sparse", 120, 0.5, 40)  # a checkpoint every 20 s
    dense = project.send("ingest", 240, 0.25)  # a checkpoint every row
    wait_for(lambda: effect_log.count(f"row:{sparse}:4") == 1
             and effect_log.count(f"row:{dense}:8") == 1, 60, "the silent worker to run both")
    other = project.worker(name="other", concurrency=2)
    store_link.silence()
    wait_for(lambda: silent.process.status == "exited", LEASE + 10,
             "the silent green worker to end itself")
    ended = time.time()
    assert silent.process.proc is not None and silent.process.proc.returncode == 3
    assert "runs in the worker's own process" in silent.process.logs()
    wait_for(lambda: all(len(_starts(effect_log, k)) >= 2 for k in (sparse, dense)),
             LEASE + 30, "the other worker to take both over")
    store_link.resume()
    wait_for(lambda: project.all_done([sparse, dense]), 180, "the work to finish")
    for key in (sparse, dense):
        starts = sorted(_starts(effect_log, key).items())
        assert starts[1][1] > ended, f"{key}: taken over before the silent worker ended"
        spans = _spans(effect_log, key)
        gaps = [later[0] - earlier[1] for earlier, later in itertools.pairwise(spans)]
        assert all(g > 0 for g in gaps), f"executions of {key} overlapped: gaps {gaps}"
    assert effect_log.count(f"notify:{sparse}") == 1, "the sparse task's step ran twice"
    assert effect_log.count(f"end:{sparse}") == 1
    assert effect_log.count(f"notify:{dense}") == 1, "the dense task's step ran twice"
    assert effect_log.count(f"charge:{dense}") == 1, "the dense task's ledger effect twice"
    other.process.stop()


@pytest.fixture
def broker_link(redis_url: str) -> Iterator[SilentLink]:
    url = make_url(redis_url)
    link = SilentLink(url.host or "127.0.0.1", url.port or 6379)
    yield link
    link.close()


def test_a_worker_whose_broker_goes_silent_hands_its_prefetched_work_to_others(
        make_project: Callable[..., Project], redis_url: str, broker_link: SilentLink,
        effect_log: EffectLog) -> None:
    project = make_project(redis_url)
    silent = project.worker(name="silent", concurrency=1, env={
        "RESILIENT_BROKER": broker_link.url_for(redis_url)})
    running = project.send("sparse", 40, 0.5, 5)
    waiting = [project.send("ingest", 3, 0.1) for _ in range(3)]
    wait_for(lambda: effect_log.count(f"row:{running}:1") == 1, 60, "the long task to run")
    wait_for(lambda: all(project.prefetched(k) for k in waiting), 30,
             "three tasks prefetched by the silent worker")
    other = project.worker(name="other", concurrency=1)
    silenced_at = time.time()
    broker_link.silence()
    wait_for(lambda: project.all_done(waiting), LEASE + 20,
             "the prefetched tasks to run elsewhere")
    handed_after = time.time() - silenced_at
    wait_for(lambda: project.state(running) == "done", 60, "the running task to finish")
    wait_for(lambda: time.time() >= silenced_at + LEASE + 10, LEASE + 20,
             "the silence to outlast the lease")
    broker_link.resume()
    for key in [running, *waiting]:
        assert effect_log.count(f"start:{key}") == 1, f"{key} ran twice"
    print(f"broker silent: prefetched work done elsewhere {handed_after:.1f}s after it "
          "went silent")
    other.process.stop()
    again = [project.send("short", n) for n in range(6)]
    wait_for(lambda: project.all_done(again), 90, "the once-silent worker to consume again")
    assert silent.process.status == "running"
