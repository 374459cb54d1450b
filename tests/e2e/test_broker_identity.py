"""Two apps on different brokers that share one store and table prefix: the second worker is
refused at start, with an error naming both brokers and the settings, instead of each
re-publishing the other's work into a broker nobody of that app consumes."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from celery_resilient.testing import wait_for

from .conftest import Project

pytestmark = pytest.mark.e2e


def test_a_worker_on_another_broker_of_the_same_store_is_refused(
        make_project: Callable[..., Project], redis_url: str, amqp_url: str) -> None:
    on_redis = make_project(redis_url)
    on_rabbit = make_project(amqp_url)  # the same store and table prefix
    first = on_redis.worker(name="first")

    refused = on_rabbit.worker(name="second", start=False)
    with pytest.raises(RuntimeError, match="exited during start"):
        refused.start()
    wait_for(lambda: refused.process.proc is not None and refused.process.proc.poll() is not None,
             30, "the refused worker to exit")
    assert refused.process.proc is not None and refused.process.proc.returncode != 0
    logs = refused.process.logs()
    assert "refusing to start" in logs
    redis_host = urlsplit(redis_url)
    assert f"{redis_host.hostname}:{redis_host.port}{redis_host.path}" in logs
    assert "amqp://127.0.0.1:5672/" in logs
    assert "resilient_table_prefix" in logs and "resilient_broker_name" in logs
    assert "guest:guest" not in logs

    # The same broker under another name is the same broker: a third worker starts.
    alias = make_project(redis_url.replace("127.0.0.1", "localhost"))
    third = alias.worker(name="third")
    key = alias.send("sleeper", 0.1, task_id="same-broker-other-name")
    wait_for(lambda: alias.state(key) == "done", 30, "the aliased worker's task to end")

    # Once every worker of the first broker stopped, the second broker's worker may start.
    first.process.stop()
    third.process.stop()
    refused.start()
    moved = on_rabbit.send("sleeper", 0.1, task_id="after-the-move")
    wait_for(lambda: on_rabbit.state(moved) == "done", 30, "the task on the new broker to end")
