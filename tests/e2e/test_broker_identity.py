"""Two apps on different brokers that share one store and table prefix: the second worker is
refused at start, with an error naming both brokers and the settings, instead of each
re-publishing the other's work into a broker nobody of that app consumes."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

import pytest
import redis

from celery_resilient.broker.identity import BrokerIdentity
from celery_resilient.core.identity import Owner
from celery_resilient.testing import wait_for
from celery_resilient.testing.services import ThrowawayRedis

from .conftest import Project

pytestmark = pytest.mark.e2e
#: Another loopback address of this host: the same server, an address that does not resolve
#: to 127.0.0.1.
OTHER_ADDRESS = "127.0.0.2"


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


def _recorded(project: Project, node: str) -> BrokerIdentity | None:
    for row in project.store.live_brokers(Owner("nobody@test", "none", 0)):
        if row.node.startswith(f"{node}@"):
            return BrokerIdentity.loads(row.broker)
    return None


def test_one_redis_through_addresses_that_do_not_meet_is_one_broker(
        make_project: Callable[..., Project]) -> None:
    """A worker that reaches the broker by another address (a network namespace, NAT) is
    recognised by the token it keeps, also after the broker lost its data; another
    Redis is refused."""
    shared = ThrowawayRedis(also_listen=[OTHER_ADDRESS]).start()
    other = ThrowawayRedis().start()
    try:
        outside = make_project(shared.url)
        inside = make_project(shared.url_on(OTHER_ADDRESS))
        outside.worker(name="outside")
        seen = wait_for(lambda: _recorded(outside, "outside"), 10, "the outside worker's row")
        assert seen.token is not None, "the broker's token was read at start"
        inside.worker(name="inside")
        key = inside.send("sleeper", 0.1, task_id="through-the-other-address")
        wait_for(lambda: inside.state(key) == "done", 30, "its task to end")

        redis.Redis.from_url(shared.url).flushall()  # the broker lost its data: a new token
        renewed = wait_for(
            lambda: (r := _recorded(outside, "outside")) is not None
            and r.token not in (None, seen.token) and r, 30,
            "the outside worker to record the broker's new token")
        wait_for(lambda: (r := _recorded(inside, "inside")) is not None
                 and r.token == renewed.token, 30, "the inside worker to record it too")
        inside.worker(name="later")  # starts: the same broker by its new token

        refused = make_project(other.url).worker(name="elsewhere", start=False)
        with pytest.raises(RuntimeError, match="exited during start"):
            refused.start()
        assert "refusing to start" in refused.process.logs()
    finally:
        other.destroy()
        shared.destroy()
