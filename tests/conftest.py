"""Shared fixtures: the real services of this machine, and isolated stores per test.

Services are never faked. A missing service fails the test (``.ci/run`` starts them); it is
not skipped.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from celery_resilient.store.sql import Store
from celery_resilient.testing.services import ThrowawayPostgres, drop_prefixed_tables

pytest_plugins = ["celery_resilient.testing.plugin"]

PG_URL = os.environ.get("RESILIENT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RESILIENT_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
#: A MariaDB (or MySQL) database of the suite's own.
MYSQL_URL = os.environ.get("RESILIENT_TEST_MYSQL_URL",
                           "mysql+pymysql://root@127.0.0.1:3306/test")
AMQP_URL = os.environ.get("RESILIENT_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

#: pytest-xdist's name for this process when the suite runs in parallel (``-n 3``: gw0, gw1,
#: gw2); empty in a plain run.
RUNNER = os.environ.get("PYTEST_XDIST_WORKER", "")
#: The Redis database of each parallel runner, gw0 first; each also gets a RabbitMQ virtual
#: host of its own, ``resilient-gw0``... Queue names and table prefixes are per test, but some
#: broker state is per database or virtual host: kombu's ``unacked`` hash (a worker with a
#: short visibility timeout restores any test's messages in it), the reliable fetch's
#: ``resilient.holders``, remote control (``revoke`` reaches every worker) and worker names
#: (tests name theirs alike: on RabbitMQ a second ``worker@host`` dies at start, its pidbox
#: queue locked by the first). Not 9 (a run without -n: one beside a parallel run stays
#: apart), 0 (the demo's) or 10-14 (owned by a test or benchmark: test_claims 11, canvas
#: chaos 14; the beat tests' second view, 10, is keyed by a prefix of each test's own).
RUNNER_REDIS_DBS = (1, 2, 3, 4, 5, 6, 7, 8, 15)


def _per_runner(runner: str) -> None:
    """Give this parallel runner a Redis database and a RabbitMQ virtual host of its own
    (the worker processes it starts inherit them through the environment)."""
    global REDIS_URL, AMQP_URL
    index = int(runner.removeprefix("gw"))
    if index >= len(RUNNER_REDIS_DBS):
        raise pytest.UsageError(f"at most {len(RUNNER_REDIS_DBS)} parallel runners (-n): "
                                f"each needs a Redis database of its own")
    REDIS_URL = urlsplit(REDIS_URL)._replace(path=f"/{RUNNER_REDIS_DBS[index]}").geturl()
    vhost = f"resilient-{runner}"
    amqp = urlsplit(AMQP_URL)
    AMQP_URL = amqp._replace(path=f"/{vhost}").geturl()
    user = amqp.username or "guest"
    try:
        for argv in (["add_vhost", vhost], ["set_permissions", "-p", vhost, user, ".*", ".*",
                                            ".*"]):
            subprocess.run(["rabbitmqctl", "-q", *argv], check=True, capture_output=True,
                           timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise pytest.UsageError(
            f"parallel runner {runner} needs the RabbitMQ virtual host {vhost}: "
            f"`rabbitmqctl add_vhost {vhost}` failed ({exc!r})") from exc
    os.environ["RESILIENT_TEST_REDIS_URL"] = REDIS_URL  # Django's settings, subprocesses
    os.environ["RESILIENT_TEST_AMQP_URL"] = AMQP_URL


if RUNNER:
    _per_runner(RUNNER)


@pytest.fixture
def pg_url() -> str:
    return PG_URL


@pytest.fixture
def mysql_url() -> str:
    return MYSQL_URL


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def amqp_url() -> str:
    return AMQP_URL


@pytest.fixture
def table_prefix(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh table prefix, so tests sharing the PostgreSQL database never see each other."""
    prefix = f"t{uuid.uuid4().hex[:10]}_"
    yield prefix
    drop_prefixed_tables(PG_URL, prefix)
    if _uses_mariadb(request):
        drop_prefixed_tables(MYSQL_URL, prefix)


def _uses_mariadb(request: pytest.FixtureRequest) -> bool:
    callspec = getattr(request.node, "callspec", None)
    return callspec is not None and "mariadb" in callspec.params.values()


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def store_url(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> str:
    """Parametrises a test over every store dialect (the contract suite)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/store.sqlite3"
    if request.param == "mariadb":
        return MYSQL_URL
    return PG_URL


@pytest.fixture
def store(store_url: str, table_prefix: str) -> Iterator[Store]:
    s = Store(store_url, table_prefix)
    s.migrate()
    yield s
    s.dispose()


@pytest.fixture
def throwaway_pg() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL cluster of the test's own (initdb on a free port) it may stop and start."""
    pg = ThrowawayPostgres().init()
    pg.start()
    try:
        yield pg
    finally:
        pg.destroy()


@pytest.fixture
def queue_name() -> str:
    """A queue of this test's own, so tests never consume each other's messages."""
    return f"q-{uuid.uuid4().hex[:10]}"
