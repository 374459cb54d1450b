"""Celery's own integration suite, run with ``ResumableTask`` as every task's base.

The suite is taken from the Celery sdist of the installed version (``pip download``, so the
index configuration of the environment applies), never copied into this repository. Its
``t/integration`` modules in :data:`MODULES` run in a subprocess with
``celery_conftest.py`` as the sdist's root ``conftest.py``: the session worker's app gets
``Resilient(app)`` on a PostgreSQL store and every task, Celery's built-ins included, is a
``ResumableTask`` (the app's ``task_cls``), as on every app the suite creates. Redis is the
broker (with the library's reliable fetch) and the result backend, with their defaults: a
``redis-server`` of the suite's own, because some of its tests count its pub/sub channels.

Plain Celery runs the same tests at the same time as the baseline. Tests that fail on purpose
are :data:`BY_DESIGN`, each with its reason in docs/guarantees.md; every other test that
passes on plain Celery must pass. A failed download fails this test.

The suite waits far more than it computes (its longest tests wait out timeouts of their own),
so each mode runs in :data:`SHARDS` parts at once, each on a Redis server, a store and a copy
of the tree of its own: about 12 minutes instead of 21.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import pytest

from celery_resilient.store.sql import Store
from celery_resilient.testing.services import ThrowawayRedis, drop_prefixed_tables
from tests.sdists import unpacked_sdist

HERE = Path(__file__).parent
DOCS = HERE.parent.parent / "docs" / "guarantees.md"
PG_URL = os.environ.get("RESILIENT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

MODULES = ("test_tasks", "test_canvas", "test_group_chains", "test_inspect",
           "test_redis_backend", "test_worker")

#: Tests that fail with ResumableTask on purpose (docs/guarantees.md, "Celery's own suite").
BY_DESIGN = {
    "test_chord::test_reapplying_frozen_chord_dispatches_body_again":
        "a frozen chord applied again is every message again under the same task ids and "
        "headers, a duplicate delivery: its body's work is done and is not run again",
    "test_Inspect::test_active": "ResumableTask is acks_late: `acknowledged` is False",
    "test_Inspect::test_query_task": "the same: `acknowledged` is False while it runs",
}
#: Celery's tests that race the worker in the test process: with the failure's mechanism.
RACES = {
    "test_task_replacement::test_replaced_task_nesting_level_0":
        "connects its task_received check, sends, then resets its flag: a worker that "
        "receives the task before the sender's next line leaves the flag False",
}
#: Runs alone a failure of a test in RACES gets before it counts (the other tests get one).
AGAIN_RACES = 3
#: What the suite needs beyond this package's own dependencies (its requirements/test.txt).
SUITE_NEEDS = ("pydantic", "pytest_rerunfailures", "pytest_order", "pytest_timeout")
#: Parts of each mode's run, at once: part i runs the i-th of every SHARDS tests
#: (``RESILIENT_CELERY_SHARD`` in celery_conftest.py); the same parts in both modes.
SHARDS = 3
#: How long the parts of the first run may take (about 12 minutes here), and the re-run
#: alone of what failed with ResumableTask only.
SUITE_SECONDS, AGAIN_SECONDS = 1500, 600


@pytest.fixture(scope="module")
def celery_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = unpacked_sdist("celery", "celery", tmp_path_factory.mktemp("celery-sdist"),
                          SUITE_NEEDS)
    assert (tree / "t" / "integration").is_dir(), f"no t/integration in {tree.name}"
    shutil.copy(HERE / "celery_conftest.py", tree / "conftest.py")
    return tree


def start_suite(tree: Path, mode: str, redis: ThrowawayRedis, prefix: str,
                tests: Sequence[str] = (), run_name: str = "",
                shard: str = "") -> tuple[subprocess.Popen[str], Path]:
    """Start Celery's suite in ``mode`` (resilient, plain) on a Redis server of its own;
    ``tests``: only these node ids; ``shard``: ``i/n``, that part of them."""
    (tree / "integration-tests-config.json").write_text(json.dumps(
        {"resilient_store_url": PG_URL, "resilient_table_prefix": prefix}))
    report = tree / f"report-{mode}{run_name}.xml"
    output = report.with_suffix(".out")  # a file, not a pipe: parts are read one by one
    base = f"redis://127.0.0.1:{redis.port}"
    bin_dir = str(Path(sys.executable).parent)  # its worker tests run the `celery` command
    env = {**os.environ, "RESILIENT_CELERY_SUITE": mode, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "RESILIENT_CELERY_SHARD": shard,
           "TEST_BROKER": f"{base}/3", "TEST_BACKEND": f"{base}/4",
           "REDIS_HOST": "127.0.0.1", "REDIS_PORT": str(redis.port),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    with output.open("w") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "pytest",
             *(tests or [f"t/integration/{m}.py" for m in MODULES]), "-q",
             "-p", "no:cacheprovider", "-p", "celery.contrib.pytest", "-p", "pytest_timeout",
             "-p", "pytest_order", "-p", "no:rerunfailures", "-o", "addopts=",
             f"--junitxml={report}", "-o", "junit_family=xunit2"],
            cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)  # its own process group: killed whole past its deadline
    return run, report


def outcome(run: subprocess.Popen[str], report: Path,
            deadline: float) -> tuple[set[str], list[str], str]:
    """The failed and passed test names of a run finished by ``deadline`` (monotonic), and
    the tail of its output; a run still going then is killed and fails the test."""
    try:
        run.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        stop(run)
        run.wait()
        out = report.with_suffix(".out").read_text(errors="replace")
        pytest.fail(f"Celery's suite ran past its deadline and was killed:\n{out[-8000:]}")
    out = report.with_suffix(".out").read_text(errors="replace")
    assert report.exists(), f"Celery's suite did not run:\n{out[-8000:]}"
    passed, failed = [], set()
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        NODE_IDS[name] = node_id(case.get("classname", ""), case.get("name", ""))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is None:
            passed.append(name)
    return failed, passed, out[-8000:]


def rerun_alone(tree: Path, prefix: str, tests: set[str], attempt: int) -> set[str]:
    """Run ``tests`` again alone with ResumableTask, on a Redis server of their own; the
    ones that failed again (the run's output is printed)."""
    server = ThrowawayRedis().start()
    migrate(prefix)
    run = start_suite(tree, "resilient", server, prefix, [NODE_IDS[n] for n in sorted(tests)],
                      run_name=f"-again{attempt}")
    try:
        again, _, again_tail = outcome(*run, time.monotonic() + AGAIN_SECONDS)
    finally:
        stop(run[0])
        server.destroy()
        drop_prefixed_tables(PG_URL, prefix)
    print(f"failed with ResumableTask only, run again alone ({attempt + 1}): {sorted(tests)}; "
          f"failed again: {sorted(again)}\n{again_tail if again else ''}")
    return again


def stop(run: subprocess.Popen[str]) -> None:
    """SIGKILL whatever is left of a run's process group (the run past its deadline, worker
    processes its tests started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.pid, signal.SIGKILL)


def migrate(prefix: str) -> None:
    """The store's schema, as an operator makes it before the first worker starts."""
    store = Store(PG_URL, prefix)
    store.migrate()
    store.dispose()


#: Test name (``class::test``) to pytest node id, as the reports name them.
NODE_IDS: dict[str, str] = {}


def node_id(classname: str, name: str) -> str:
    """``t.integration.test_tasks.test_tasks`` + ``test_x`` -> a pytest node id."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        if Path(*parts[:cut]).with_suffix(".py").name.startswith("test_") and \
                parts[cut - 1] in MODULES:
            return "::".join(["/".join(parts[:cut]) + ".py", *parts[cut:], name])
    return f"{classname}::{name}"


@pytest.mark.timeout(SUITE_SECONDS + AGAIN_RACES * AGAIN_SECONDS + 300)  # it waits
def test_celery_suite_passes_with_resumable_task_as_every_base(
        celery_tree: Path, tmp_path: Path) -> None:
    """Both modes at once, each part on a Redis server and a copy of the tree of its own:
    plain Celery in the same run is the baseline (what fails there fails for reasons of its
    own: this machine, test order)."""
    prefixes = [f"cs{uuid.uuid4().hex[:8]}_" for _ in range(SHARDS)]
    for prefix in prefixes:
        migrate(prefix)
    servers = [ThrowawayRedis().start() for _ in range(2 * SHARDS)]
    runs: list[tuple[subprocess.Popen[str], Path]] = []
    try:
        for mode, first_server in (("resilient", 0), ("plain", SHARDS)):
            for i in range(SHARDS):
                tree = tmp_path / f"{mode}-{i}"
                shutil.copytree(celery_tree, tree)
                runs.append(start_suite(tree, mode, servers[first_server + i], prefixes[i],
                                        shard=f"{i}/{SHARDS}"))
        deadline = time.monotonic() + SUITE_SECONDS
        results = [outcome(*run, deadline) for run in runs]
    finally:
        for run, _ in runs:
            stop(run)
        for server in servers:
            server.destroy()
        for prefix in prefixes:
            drop_prefixed_tables(PG_URL, prefix)
    failed = set().union(*(r[0] for r in results[:SHARDS]))
    passed = [name for r in results[:SHARDS] for name in r[1]]
    tail = "\n".join(f"-- part {i}:\n{r[2][-4000:]}" for i, r in enumerate(results[:SHARDS]))
    plain_failed = set().union(*(r[0] for r in results[SHARDS:]))
    plain_passed = [name for r in results[SHARDS:] for name in r[1]]
    plain_tail = "\n".join(f"-- part {i}:\n{r[2][-4000:]}"
                           for i, r in enumerate(results[SHARDS:]))
    assert len(plain_passed) >= 300 and len(plain_failed) <= 12, (
        f"plain Celery's run is no baseline ({len(plain_passed)} passed, "
        f"{sorted(plain_failed)} failed):\n{plain_tail}")
    unexpected = failed - BY_DESIGN.keys() - plain_failed
    if unexpected:
        # Some of Celery's tests race the worker (a signal handler set up after the send):
        # a failure that does not come back when the test runs again alone is such a race;
        # one that does is a failure. The tests in RACES lose their race under load on
        # either side (the re-run shares the machine with the rest of CI): they get up to
        # AGAIN_RACES runs alone, every other test one. Each re-run is printed.
        again = set(unexpected)
        for attempt in range(AGAIN_RACES):
            again = rerun_alone(celery_tree, prefixes[0], again, attempt)
            if again - RACES.keys() or not again:
                break
        assert again == set(), (
            f"failures with ResumableTask only, again when run alone: {sorted(again)}\n"
            f"first run:\n{tail}")
    assert BY_DESIGN.keys() - failed == set(), (
        "these tests pass now: remove them from BY_DESIGN and docs/guarantees.md")
    assert len(passed) >= 300, f"only {len(passed)} of Celery's tests passed:\n{tail}"


def test_every_by_design_failure_is_documented() -> None:
    text = DOCS.read_text()
    undocumented = [name for name in {**BY_DESIGN, **RACES} if name.split("::")[1] not in text]
    assert not undocumented, f"docs/guarantees.md does not list {undocumented}"
