"""RedBeat's own test suite, run against ``ResilientScheduler``.

The suite is taken from the celery-redbeat sdist of the installed version (``pip download``,
so the index configuration of the environment applies), never copied into this repository.
Its ``tests/`` run in a subprocess with ``redbeat_conftest.py`` as ``conftest.py``: every
``RedBeatScheduler`` they build is a ``ResilientScheduler`` on an app with ``Resilient(app)``.
The tests that fail by design are :data:`BY_DESIGN`, each listed with its reason in
docs/beat.md; every other test must pass. A failed download fails this test (no skip).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.sdists import unpacked_sdist

HERE = Path(__file__).parent
DOCS = HERE.parent.parent / "docs" / "beat.md"

#: RedBeat tests that fail against ResilientScheduler on purpose (see docs/beat.md).
BY_DESIGN = {
    "test_RedBeatScheduler_tick::test_lock_timeout":
        "the lock timeout defaults to min(5 x beat_max_loop_interval, 30 s), not 1500 s",
    "RedBeatLockTimeoutDefaultValues::test_no_values":
        "the same 30 s lock default",
    "test_RedBeatScheduler_tick::test_due_now":
        "each send carries a task id and the slot headers",
    "test_RedBeatScheduler_tick::test_due_later_task_never_run":
        "the next slot comes from the interval's run_every grid, not remaining_estimate()",
}
#: What the suite needs beyond this package's own dependencies (its requirements-dev.txt).
SUITE_NEEDS = ("fakeredis", "pytz", "dateutil")


@pytest.fixture(scope="module")
def redbeat_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = unpacked_sdist("celery-redbeat", "redbeat", tmp_path_factory.mktemp("redbeat-sdist"),
                          SUITE_NEEDS)
    assert (tree / "tests").is_dir(), f"no tests/ in {tree.name}"
    shutil.copy(HERE / "redbeat_conftest.py", tree / "conftest.py")
    return tree


# Alone: some of RedBeat's tests time a tick to 200 ms (test_due_next_just_ran: the next
# slot is between 0.8 and 1 s away), which a busy machine overruns.
@pytest.mark.alone
def test_redbeat_suite_passes_against_resilient_scheduler(redbeat_tree: Path) -> None:
    report = redbeat_tree / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
         "-p", "no:celery", f"--junitxml={report}", "-o", "junit_family=xunit2"],
        cwd=redbeat_tree, capture_output=True, text=True, timeout=180, check=False)
    assert report.exists(), f"RedBeat's suite did not run:\n{run.stdout}\n{run.stderr}"
    passed, failed, skipped = [], set(), []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(name)
        elif case.find("skipped") is not None:
            skipped.append(name)
        else:
            passed.append(name)
    tail = run.stdout[-6000:]
    assert failed - BY_DESIGN.keys() == set(), f"unexpected RedBeat failures:\n{tail}"
    assert BY_DESIGN.keys() - failed == set(), (
        "these RedBeat tests pass now: remove them from BY_DESIGN and docs/beat.md")
    assert len(passed) >= 70, f"only {len(passed)} RedBeat tests passed:\n{tail}"
    assert len(skipped) <= 2, f"RedBeat tests skipped: {skipped}"  # its own two @skip


def test_every_by_design_failure_is_documented() -> None:
    text = DOCS.read_text()
    undocumented = [name for name in BY_DESIGN if name.split("::")[1] not in text]
    assert not undocumented, f"docs/beat.md does not list {undocumented}"
