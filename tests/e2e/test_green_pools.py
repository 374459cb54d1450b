"""Kill and resume on every pool: resumed work goes first, within 2 s of the restart.

One worker (prefork, threads, gevent, eventlet, solo), Redis with its defaults (the one-hour
visibility timeout), PostgreSQL. Long checkpointing tasks fill every pool slot and a backlog
of never-started ones, larger than the prefetch window, waits behind them. The worker's main
process is SIGKILLed mid-task (prefork children die with it: PR_SET_PDEATHSIG) and started
again, in the same PID namespace or in a new one (as a container restart is). Each killed
task must run again from its checkpoint within :data:`AGAIN_WITHIN` of the restart's ready
line, before any never-started work takes a slot, and every unit must end exactly once.

Before the fix a dead worker's holding went back to its queue in the order of its delivery
tags (random), not in the order it had been fetched: the restarted worker's first fetches
mixed killed and never-started work, and a killed task waited for a slot behind a backlog
task (measured: prefork -c 2 7.8 s, threads -c 4 7.8-10.3 s, eventlet -c 4 2.6 s after the
ready line; broker/holdings.py, ``restore_order``).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from datetime import datetime

import pytest

from celery_resilient.core import codec
from celery_resilient.testing import EffectLog, wait_for

from .conftest import Project

PID_NS = ("unshare", "--pid", "--fork", "--mount-proc")
#: The killed tasks: long enough to be mid-task at the kill and after the restart.
LONG_ROWS, LONG_DELAY = 24, 0.25
#: The backlog: each never-started task holds a slot this long once it runs.
BACKLOG_ROWS, BACKLOG_DELAY = 10, 0.25
#: Restart (ready line) to the killed tasks' resumed starts.
AGAIN_WITHIN = 2.0
PREFETCH = 4  # tests/e2e/envapp.py: worker_prefetch_multiplier


def _pool(name: str, concurrency: int, wrapper: tuple[str, ...] = ()) -> object:
    marks = []
    if name in ("gevent", "eventlet") and importlib.util.find_spec(name) is None:
        marks.append(pytest.mark.skip(reason=f"{name} is not installed (the dev group has it)"))
    label = f"{name}-{concurrency}" + ("-pidns" if wrapper else "")
    return pytest.param(name, concurrency, wrapper, id=label, marks=marks)


POOLS = [
    _pool("prefork", 2),
    _pool("threads", 4),
    _pool("gevent", 4),
    _pool("eventlet", 4),
    _pool("solo", 1),
    _pool("prefork", 2, PID_NS),
    _pool("threads", 4, PID_NS),
]


def _checkpointed(project: Project, key: str) -> int:
    found = project.store.load_checkpoint(key)
    return 0 if found is None else int(codec.decode(found[0])["row"])


def _ready_at(log: str) -> float:
    line = next(ln for ln in log.splitlines() if ln.endswith(" ready."))
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _assert_once(effects: EffectLog, keys: list[str], rows: int, killed: set[str]) -> None:
    """Every unit ended once: its step and ledger effect once, each row once (a killed
    unit's row in flight at the kill may have run twice)."""
    counts = effects.counts()
    for key in keys:
        assert counts[f"notify:{key}"] == 1 and counts[f"charge:{key}"] == 1, key
        twice = [i for i in range(rows) if counts[f"row:{key}:{i}"] == 2]
        wrong = [i for i in range(rows) if counts[f"row:{key}:{i}"] not in (1, 2)]
        assert not wrong, f"{key}: rows missing or repeated more than once: {wrong}"
        assert len(twice) <= (1 if key in killed else 0), f"{key}: rows run twice: {twice}"


@pytest.mark.parametrize(("pool", "concurrency", "wrapper"), POOLS)
def test_killed_work_resumes_first_within_2s_of_the_restart(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog,
        pool: str, concurrency: int, wrapper: tuple[str, ...]) -> None:
    project = make_project(redis_url)
    worker = project.worker(concurrency=concurrency, pool=pool, wrapper=wrapper)
    if wrapper:
        assert "liveness=session" in worker.process.logs()
    longs = [project.send("ingest", LONG_ROWS, LONG_DELAY, task_id=f"long-{i}")
             for i in range(concurrency)]
    wait_for(lambda: all(effect_log.count(f"start:{k}") for k in longs), 30,
             "every long task to start")
    # more than the prefetch window behind them, sent after they started
    backlog = [project.send("ingest", BACKLOG_ROWS, BACKLOG_DELAY, task_id=f"backlog-{i}")
               for i in range(PREFETCH * concurrency + concurrency)]
    wait_for(lambda: all(_checkpointed(project, k) >= 3 for k in longs), 30,
             "every long task to checkpoint 3 rows")
    assert not any(effect_log.count(f"start:{k}") for k in backlog), "a backlog task ran"
    # the main process only (its pool processes die with it), then the group is reaped
    worker.process.kill("SIGKILL", group=False)
    saved = {k: _checkpointed(project, k) for k in longs}
    started = time.time()
    worker.restart()
    ready = _ready_at(worker.process.logs())
    resumed = wait_for(lambda: [e for k in longs for e in effect_log.entries(f"start:{k}")[1:]]
                       if all(len(effect_log.entries(f"start:{k}")) >= 2 for k in longs)
                       else None, 60, "every killed task to run again")
    wait_for(lambda: project.all_done([*longs, *backlog]), 120, "every unit to end")

    after = {e["effect"].removeprefix("start:"): e["ts"] for e in resumed}
    delays = sorted(after[k] - ready for k in longs)
    print(f"\n[{pool} -c {concurrency}{' pid-ns' if wrapper else ''}] killed tasks ran again "
          f"{delays[0]:.2f}-{delays[-1]:.2f}s after the ready line (process start to ready "
          f"{ready - started:.2f}s)")
    for e in resumed:  # from its checkpoint, not from zero
        key = e["effect"].removeprefix("start:")
        assert e["row"] == saved[key] > 0, f"{key} resumed from row {e['row']}, saved {saved[key]}"
    assert delays[-1] <= AGAIN_WITHIN, f"killed work ran again {delays[-1]:.2f}s after ready"
    first_backlog = min(effect_log.entries(f"start:{k}")[0]["ts"] for k in backlog)
    assert first_backlog >= max(after.values()), "never-started work took a slot first"
    _assert_once(effect_log, longs, LONG_ROWS, set(longs))
    _assert_once(effect_log, backlog, BACKLOG_ROWS, set())
    assert "ANOTHER LIVE WORKER" not in worker.process.logs()
