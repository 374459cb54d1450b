"""On a MariaDB store, a payload over the server's ``max_allowed_packet`` fails its task once.

Before, the server's refusal (1153, or a dropped connection) read as a store outage: the task
was re-sent with backoff for ever, its body run again on every copy. A real worker runs a
task whose result is 17 MiB and one whose arguments are: each ends FAILURE for the caller
with :class:`PayloadTooLarge` naming the limit, the body ran once (the other never ran), no
copy was re-sent, and a small task beside them is done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_resilient.errors import PayloadTooLarge
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.services import drop_prefixed_tables

from .conftest import Project

pytestmark = pytest.mark.e2e
OVER = 17 * 1024 * 1024  # MariaDB's default max_allowed_packet is 16 MiB


@pytest.fixture
def project(make_project: Callable[..., Project], redis_url: str, mysql_url: str,
            table_prefix: str) -> Iterator[Project]:
    made = make_project(redis_url, mysql_url)
    made.extra = {"result_backend": redis_url}
    yield made
    made.close()
    drop_prefixed_tables(mysql_url, table_prefix)


def test_an_oversized_result_or_message_fails_once_not_for_ever(
        project: Project, effect_log: EffectLog) -> None:
    worker = project.worker(concurrency=2)
    big_result = project.send("sized", OVER, task_id="big-result")
    big_args = project.send("short", 1, "a" * OVER, task_id="big-args")
    small = project.send("short", 2, task_id="small")
    backend = Celery(backend=project.extra["result_backend"]).backend

    def failed(key: str) -> dict[str, Any] | None:
        meta: dict[str, Any] = backend.get_task_meta(key, cache=False)
        return meta if meta["status"] == "FAILURE" else None

    for key in (big_result, big_args):
        meta = wait_for(functools.partial(failed, key), 60, f"FAILURE for {key}")
        assert meta is not None
        error = meta["result"]
        assert isinstance(error, PayloadTooLarge), meta
        assert "max_allowed_packet of 16,777,216 bytes" in str(error), meta
    wait_for(lambda: project.state(small) == "done", 60, "the small task to end done")

    row = project.store.get_work(big_result)
    assert row is not None and row.state == "failed", row
    assert "max_allowed_packet" in (row.error or ""), row
    assert project.store.get_work(big_args) is None  # no claim half-written
    # One execution of the body, none of the other, and no copy re-sent as an outage: give
    # a re-sent copy (the first backoff is 1 s) time to arrive and run.
    wait_for(lambda: worker.process.logs().count("PayloadTooLarge") >= 2, 30,
             "both failures logged")
    project.send("short", 3, task_id="after")
    wait_for(lambda: project.state("after") == "done", 60, "a task sent after them to end")
    counts = effect_log.counts()
    assert counts["sized:big-result"] == 1 and counts["short:big-args"] == 0, counts
    logs = worker.process.logs()
    assert "re-sent in" not in logs and "store unavailable" not in logs, logs[-3000:]
