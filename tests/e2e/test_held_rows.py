"""A body's long ``ledger.atomic()`` block does not stall its worker's other tasks.

The block's transaction holds the body's work row until it commits. The worker's batched
takes mark each claim started once its pool process accepted it; a mark of that row used to
wait for the block, and every other delivery's take in the same batch waited behind it: on
MariaDB, small tasks on the same worker stopped for as long as the block was held, with pool
processes idle. A real worker on each server store runs a block held until the test lets it
go; 20 small tasks sent meanwhile must all end while it is still held, and the block's own
task then ends once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.services import drop_prefixed_tables

from .conftest import Project

pytestmark = pytest.mark.e2e
SMALL = 20


@pytest.fixture(params=["postgresql", "mariadb"])
def project(request: pytest.FixtureRequest, make_project: Callable[..., Project],
            redis_url: str, pg_url: str, mysql_url: str,
            table_prefix: str) -> Iterator[Project]:
    url = pg_url if request.param == "postgresql" else mysql_url
    made = make_project(redis_url, url)
    yield made
    made.close()
    if request.param == "mariadb":
        drop_prefixed_tables(mysql_url, table_prefix)


def test_small_tasks_end_while_another_body_holds_its_row(
        project: Project, effect_log: EffectLog, tmp_path: Path) -> None:
    worker = project.worker(concurrency=3)
    flag = tmp_path / "let-go"
    held = project.send("held_atomic", str(flag), task_id="held")
    wait_for(lambda: effect_log.count("atomic-held:held") == 1, 30, "the block to hold its row")
    # repeat the race a few times: each burst's marks travel with takes while the row is held
    keys: list[str] = []
    for burst in range(4):
        sent = [project.send("short", i, task_id=f"small-{burst}-{i}")
                for i in range(SMALL // 4)]
        keys += sent
        wait_for(lambda s=sent: all(project.state(k) == "done" for k in s), 30,  # type: ignore[misc]
                 f"burst {burst}'s small tasks to end while the block holds its row")
    assert not flag.exists() and effect_log.count("atomic-end:held") == 0
    row = project.store.get_work(held)
    assert row is not None and row.state == "running"
    flag.touch()
    wait_for(lambda: project.state(held) == "done", 30, "the block's task to end")
    counts = effect_log.counts()
    assert counts["atomic-held:held"] == 1 and counts["atomic-end:held"] == 1, counts
    assert all(counts[f"short:{k}"] == 1 for k in keys), counts
    assert "Traceback" not in worker.process.logs()


def test_a_worker_killed_while_a_body_holds_its_row_applies_the_block_once(
        project: Project, effect_log: EffectLog, tmp_path: Path) -> None:
    """The whole worker SIGKILLed while the block holds its row (its started mark possibly
    skipped): the block's transaction dies with it, the restarted worker takes the work back
    and runs the block again, and its marker and effect commit once; small tasks sent beside
    it end once each."""
    worker = project.worker(concurrency=3)
    flag = tmp_path / "let-go"
    held = project.send("held_atomic", str(flag), task_id="held-kill")
    wait_for(lambda: effect_log.count("atomic-held:held-kill") == 1, 30,
             "the block to hold its row")
    keys = [project.send("short", i, task_id=f"beside-{i}") for i in range(5)]
    wait_for(lambda: all(project.state(k) == "done" for k in keys), 30,
             "the small tasks to end while the block holds its row")
    worker.kill("SIGKILL")
    worker.restart()
    wait_for(lambda: effect_log.count("atomic-held:held-kill") == 2, 90,
             "the restarted worker to run the block again")
    flag.touch()
    wait_for(lambda: project.state(held) == "done", 30, "the block's task to end")
    counts = effect_log.counts()
    assert counts["atomic-end:held-kill"] == 1, counts
    assert project.store.ledger_get("held-kill:atomic") is not None  # its marker
    assert all(counts[f"short:{k}"] == 1 for k in keys), counts
