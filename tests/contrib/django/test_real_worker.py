"""The operator's proof for Django: one store for the worker, ``manage.py`` and the celery CLI.

A Django project laid out as docs/django.md says (``djproj``: no store URL, so the store is
``DATABASES["default"]``, here pytest-django's test database on PostgreSQL), run by real
processes: ``manage.py check`` and ``resilient_migrate``, a real ``celery worker``
SIGKILLed mid-task and restarted, then ``celery -A djproj resilient work --json`` and
``manage.py resilient_status --json`` read the same done work from Django's database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from django.db import connections
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from celery_resilient.core import codec
from celery_resilient.store.sql import Store
from celery_resilient.testing import wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.services import drop_prefixed_tables

from . import settings as test_settings

# Its projects make their own databases on each engine; the pass on MySQL (scripts/test.sh)
# would only run them again.
pytestmark = pytest.mark.skipif(test_settings.engine_under_test != "postgresql",
                                reason="runs its PostgreSQL and MySQL projects in the "
                                       "PostgreSQL pass")

PROJECT = "tests.contrib.django.djproj"
PASSWORD = "s3cret-not-for-logs"
ROWS, DELAY = 20, 0.2


@pytest.fixture
def project(django_db_setup: Any, tmp_path: Path,
            request: pytest.FixtureRequest) -> Any:
    db_name = connections["default"].settings_dict["NAME"]
    tag = uuid.uuid4().hex[:8]
    env = {
        "DJANGO_SETTINGS_MODULE": f"{PROJECT}.settings",
        "DJPROJ_DB_NAME": db_name,
        "DJPROJ_TABLE_PREFIX": f"djw{tag}_",
        "DJPROJ_QUEUE": f"djproj-{tag}",
        "PYTHONPATH": os.pathsep.join([str(request.config.rootpath),
                                       os.environ.get("PYTHONPATH", "")]),
    }
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{db_name}"
    yield env, url
    drop_prefixed_tables(url, env["DJPROJ_TABLE_PREFIX"])


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command as an operator types it, in a directory without the project in it."""
    return subprocess.run([sys.executable, "-m", *argv], env={**os.environ, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False,
                          stdin=subprocess.DEVNULL)


def _manage(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run(["django", *args], env, cwd)  # what manage.py runs, with the same settings


def _celery(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return _run(["celery", "-A", PROJECT, "resilient", *args], env, cwd)


def _schema_missing_then_migrated(env: dict[str, str], cwd: Path,
                                  user: str = "postgres:***@") -> str:
    """Before the migration the celery CLI looks at Django's database (not a SQLite file),
    says the schema is missing there, as JSON, and exits 1, as ``resilient_status`` does;
    the system check names the store and the command. Returns the store as shown."""
    db_name = env["DJPROJ_DB_NAME"]
    before = _celery("status", "--json", env=env, cwd=cwd)
    assert before.returncode == 1, before.stderr
    data = json.loads(before.stdout)
    assert data["store"].endswith(f"/{db_name}") and user in data["store"]
    assert "is missing" in data["error"] and PASSWORD not in before.stdout
    same = _manage("resilient_status", "--json", env=env, cwd=cwd)
    assert same.returncode == 1
    assert json.loads(same.stdout)["store"] == data["store"]
    check = _manage("check", "--database", "default", env=env, cwd=cwd)
    assert check.returncode == 0, check.stderr
    assert "celery_resilient.W001" in check.stderr and f"/{db_name}" in check.stderr
    assert "python manage.py resilient_migrate" in check.stderr

    migrated = _manage("resilient_migrate", "--json", env=env, cwd=cwd)
    assert migrated.returncode == 0, migrated.stderr
    info = json.loads(migrated.stdout)
    assert info["changed"] and info["revision"] == info["head"]
    assert info["store"] == data["store"]
    check = _manage("check", "--database", "default", env=env, cwd=cwd)
    assert "celery_resilient.W001" not in check.stderr
    return str(data["store"])


def _kill_mid_task_and_resume(env: dict[str, str], url: str, log_dir: Path,
                              rootpath: Path) -> str:
    """A real worker, SIGKILLed mid-task, restarted: the work resumes from its checkpoint
    and ends done. Returns its work key."""
    store = Store(url, env["DJPROJ_TABLE_PREFIX"])
    client = Celery("djproj-client", broker=test_settings.CELERY_BROKER_URL,
                    set_as_current=False)
    worker = LocalWorker(PROJECT, log_dir, name="djworker", queues=(env["DJPROJ_QUEUE"],),
                         env=env, cwd=str(rootpath))
    try:
        worker.start()
        key = str(client.send_task("djproj.ingest", args=(ROWS, DELAY),
                                   queue=env["DJPROJ_QUEUE"]).id)

        def checkpointed() -> int:
            found = store.load_checkpoint(key)
            return 0 if found is None else int(codec.decode(found[0])["row"])

        wait_for(lambda: checkpointed() >= 4, 60, "4 checkpointed rows")
        worker.kill("SIGKILL")  # main process and pool child, mid-task
        saved = checkpointed()
        row = store.get_work(key)
        assert row is not None and row.state == "running"
        worker.restart()
        wait_for(lambda: (store.get_work(key) or row).state == "done", 90,
                 "the work to finish after the restart")
        row = store.get_work(key)
        assert row is not None and row.epoch == 2
        result = codec.decode(row.result_json)
        assert result["executions"] == 2 and result["resumed_at"] >= saved > 0
        return key
    finally:
        worker.process.teardown()
        store.dispose()
        client.close()


@pytest.fixture
def mysql_project(mysql_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """The same project on Django's MySQL backend, in a MariaDB database of its own."""
    server = make_url(mysql_url)
    tag = uuid.uuid4().hex[:8]
    db_name = f"djm_{tag}"
    admin = create_engine(server)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE {db_name} CHARACTER SET utf8mb4"))
    env = {
        "DJANGO_SETTINGS_MODULE": f"{PROJECT}.settings",
        "DJPROJ_DB_ENGINE": "mysql",
        "DJPROJ_DB_NAME": db_name,
        "DJPROJ_MYSQL_USER": server.username or "root",
        "DJPROJ_MYSQL_PASSWORD": server.password or "",
        "DJPROJ_MYSQL_HOST": server.host or "127.0.0.1",
        "DJPROJ_MYSQL_PORT": str(server.port or 3306),
        "DJPROJ_TABLE_PREFIX": f"djw{tag}_",
        "DJPROJ_QUEUE": f"djproj-{tag}",
        "PYTHONPATH": os.pathsep.join([str(request.config.rootpath),
                                       os.environ.get("PYTHONPATH", "")]),
    }
    try:
        yield env, server.set(database=db_name).render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {db_name}"))
        admin.dispose()


@pytest.mark.parametrize("engine", ["postgresql", "mysql"])
def test_worker_manage_py_and_celery_cli_share_django_database(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """On Django's PostgreSQL backend, and on its MySQL backend (MariaDB)."""
    env, url = request.getfixturevalue("project" if engine == "postgresql"
                                       else "mysql_project")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    shown = _schema_missing_then_migrated(
        env, cwd, "postgres:***@" if engine == "postgresql" else
        f"{env['DJPROJ_MYSQL_USER']}@")
    key = _kill_mid_task_and_resume(env, url, tmp_path / "logs", request.config.rootpath)

    listed = _celery("work", "--json", env=env, cwd=cwd)
    assert listed.returncode == 0, listed.stderr
    work = {w["work_key"]: w for w in json.loads(listed.stdout)}
    assert work[key]["state"] == "done" and work[key]["attempts"] == 2

    status = _manage("resilient_status", "--json", env=env, cwd=cwd)
    assert status.returncode == 0, status.stderr
    by_manage = json.loads(status.stdout)
    assert by_manage["store"] == shown
    assert by_manage["work"] == {"done": 1}
    by_celery = json.loads(_celery("status", "--json", env=env, cwd=cwd).stdout)
    assert by_celery.keys() == by_manage.keys()
    assert by_celery["work"] == by_manage["work"] == {"done": 1}
    assert {w["incarnation"] for w in by_celery["workers"]} == {
        w["incarnation"] for w in by_manage["workers"]}
    assert len(by_manage["workers"]) == 2  # the killed start and the restart

    # Nothing fell back to the SQLite file in the working directory.
    assert list(cwd.iterdir()) == []


def test_manage_py_test_parallel_gives_each_process_its_clone(tmp_path: Path,
                                                             request: pytest.FixtureRequest
                                                             ) -> None:
    """``manage.py test --parallel 2``: every test process's store is its own clone of the
    test database (not the parent's, shared by all), emptied per test by the mixin."""
    tag = uuid.uuid4().hex[:8]
    env = {
        "DJANGO_SETTINGS_MODULE": f"{PROJECT}.settings",
        "DJPROJ_DB_NAME": f"djpar_{tag}",  # never created: a write to it would fail loudly
        "DJPROJ_TABLE_PREFIX": f"djp{tag}_",
        "PYTHONPATH": os.pathsep.join([str(request.config.rootpath),
                                       os.environ.get("PYTHONPATH", "")]),
    }
    done = _manage("test", "--parallel", "2", "--noinput", f"{PROJECT}.partests", env=env,
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Ran 4 tests" in done.stderr and "OK" in done.stderr, done.stderr[-3000:]
