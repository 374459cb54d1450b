"""Settings: Celery's CELERY namespace, the DATABASES default, the settings check."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from sqlalchemy import text
from sqlalchemy.engine import make_url

from celery_resilient import ConfigurationError, Resilient
from celery_resilient.contrib.django import celery_app, configure_from_django, database_url
from celery_resilient.contrib.django.apps import check_settings
from celery_resilient.contrib.django.conf import resilient_apps
from celery_resilient.store.sql import Store

from . import settings as test_settings

PASSWORD = "s3cret-not-for-logs"


def _django_app() -> Celery:
    app = Celery("djproj-settings", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    Resilient(app)
    return app


def test_celery_namespace_maps_resilient_settings(project_app: Celery) -> None:
    cfg = Resilient.of(project_app).config
    assert cfg.table_prefix == "djr_"  # CELERY_RESILIENT_TABLE_PREFIX
    assert cfg.lease_seconds == 20.0  # CELERY_RESILIENT_LEASE_SECONDS
    assert cfg.auto_migrate is False


def test_store_defaults_to_the_default_database_without_logging_the_password(
        project_app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="celery_resilient")
    rt = Resilient.of(celery_app())  # RESILIENT_CELERY_APP, as the admin finds it
    assert rt.app is project_app
    url = make_url(rt.config.store_url)
    # The test database pytest-django created (its name is set after Django's setup).
    assert url.drivername == test_settings.store_driver
    assert url.database == connection.settings_dict["NAME"]
    assert url.database.startswith("test_resilient_django_")
    assert url.password == PASSWORD
    assert rt.store.count_by_state() == {}  # a real connection to that database
    assert "store defaults to Django's 'default' database" in caplog.text
    assert PASSWORD not in caplog.text
    assert f"{url.username}:***@" in caplog.text


def test_explicit_store_url_wins(db: Any, settings: Any, tmp_path: Any) -> None:
    settings.CELERY_RESILIENT_STORE_URL = f"sqlite:///{tmp_path}/explicit.db"
    app = _django_app()
    configure_from_django(app)
    assert Resilient.of(app).config.store_url == f"sqlite:///{tmp_path}/explicit.db"


def test_app_config_ready_defaults_only_apps_that_read_django_settings(db: Any) -> None:
    from_django = _django_app()
    elsewhere = Celery("not-django", set_as_current=False)
    elsewhere.conf.resilient_table_prefix = "x_"
    Resilient(elsewhere)
    found = resilient_apps()
    assert from_django in found and elsewhere not in found

    apps.get_app_config("celery_resilient").ready()  # what Django's setup runs
    assert Resilient.of(from_django).config.store_url.startswith(
        test_settings.store_driver + "://")
    assert Resilient.of(elsewhere).config.store_url.startswith("sqlite:///")


STANDARD_LAYOUT = """
import json, os
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.contrib.django.settings"
from celery import Celery
from celery_resilient import Resilient
from celery_resilient.store.engine import sanitize_url
# proj/celery.py, imported by proj/__init__.py before Django is set up
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
Resilient(app)
import django
django.setup()  # runs CeleryResilientConfig.ready()
from django.conf import settings
del settings.RESILIENT_CELERY_APP
from celery_resilient.contrib.django import celery_app, runtime
print(json.dumps({"found": celery_app() is app,
                  "store_url": sanitize_url(runtime().config.store_url)}))
"""


def test_standard_layout_needs_no_more_than_installed_apps(
        request: pytest.FixtureRequest) -> None:
    """A fresh process laid out like ``proj/celery.py``: the app is found and defaulted."""
    done = subprocess.run([sys.executable, "-c", STANDARD_LAYOUT], capture_output=True,
                          text=True, timeout=60, check=False, cwd=request.config.rootpath,
                          env={**os.environ, "PYTHONPATH": str(request.config.rootpath)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"found": True, "store_url": test_settings.store_url_shown}
    assert PASSWORD not in done.stdout + done.stderr


def test_several_django_apps_without_the_setting_are_ambiguous(
        db: Any, settings: Any) -> None:
    del settings.RESILIENT_CELERY_APP
    first, second = _django_app(), _django_app()
    assert {first, second} <= set(resilient_apps())
    with pytest.raises(ImproperlyConfigured, match="are loaded; set RESILIENT_CELERY_APP"):
        celery_app()


def test_celery_app_setting_must_name_a_celery_app(db: Any, settings: Any) -> None:
    settings.RESILIENT_CELERY_APP = "tests.contrib.django.settings:DATABASES"
    with pytest.raises(ImproperlyConfigured, match="is not a Celery app"):
        celery_app()


@pytest.mark.parametrize(("db_settings", "expected"), [
    ({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
      "PASSWORD": "p@ss:w/rd", "HOST": "db.internal", "PORT": 6432,
      "OPTIONS": {"sslmode": "require", "pool": True, "isolation_level": 2}},
     "postgresql+psycopg://app:p%40ss%3Aw%2Frd@db.internal:6432/shop?sslmode=require"),
    ({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "", "HOST": "",
      "PORT": ""}, "postgresql+psycopg:///shop"),
    ({"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/app/db.sqlite3"},
     "sqlite:////srv/app/db.sqlite3"),
    ({"ENGINE": "django.db.backends.postgresql", "NAME": "shop", "USER": "app",
      "HOST": "/var/run/postgresql", "PORT": "5432"},
     "postgresql+psycopg://app@:5432/shop?host=%2Fvar%2Frun%2Fpostgresql"),
    ({"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "app",
      "PASSWORD": "p@ss:w/rd", "HOST": "db.internal", "PORT": "3306",
      "OPTIONS": {"charset": "utf8mb4", "init_command": "SET sql_mode='STRICT_TRANS_TABLES'",
                  "isolation_level": "read committed",
                  "ssl": {"ca": "/etc/ssl/ca.pem", "cert": "/etc/ssl/c.pem",
                          "key": "/etc/ssl/k.pem"}}},
     "mysql+pymysql://app:p%40ss%3Aw%2Frd@db.internal:3306/shop?charset=utf8mb4"
     "&init_command=SET+sql_mode%3D%27STRICT_TRANS_TABLES%27&ssl_ca=%2Fetc%2Fssl%2Fca.pem"
     "&ssl_cert=%2Fetc%2Fssl%2Fc.pem&ssl_key=%2Fetc%2Fssl%2Fk.pem"),
    ({"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "app",
      "HOST": "/run/mysqld/mysqld.sock"},
     "mysql+pymysql://app@/shop?unix_socket=%2Frun%2Fmysqld%2Fmysqld.sock"),
])
def test_database_url_conversion(db_settings: dict[str, Any], expected: str) -> None:
    url = database_url("default", {"default": db_settings})
    assert url == expected
    if "PASSWORD" in db_settings:
        assert make_url(url).password == db_settings["PASSWORD"]  # escaped, not mangled


def test_a_project_with_only_mysqlclient_gets_a_mysqldb_store_url(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Django's default MySQL driver is mysqlclient: a project that has it and not PyMySQL
    gets a store on it rather than an engine that cannot load."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pymysql" else real(name, *a))
    db = {"ENGINE": "django.db.backends.mysql", "NAME": "shop", "USER": "app",
          "HOST": "db.internal", "OPTIONS": {"charset": "utf8mb4"}}
    assert database_url("default", {"default": db}) == (
        "mysql+mysqldb://app@db.internal/shop?charset=utf8mb4")


def test_a_unix_socket_host_reaches_the_server_as_django_does() -> None:
    """Django's documented socket form (``HOST`` = the socket directory) must not become
    part of the database name."""
    url = database_url("default", {"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": "test", "USER": "postgres",
        "HOST": "/var/run/postgresql", "PORT": "5432"}})
    store = Store(url, "unused_")
    try:
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() == "test"
            assert conn.execute(text("SELECT inet_server_addr()")).scalar() is None  # socket
    finally:
        store.dispose()


def test_a_mysql_database_reaches_the_server_with_its_options(mysql_url: str) -> None:
    """Django's MySQL settings (the test server's, from RESILIENT_TEST_MYSQL_URL) become a
    store URL whose connections carry the OPTIONS: ``init_command`` runs, the charset is
    utf8mb4, and the store's own session settings (UTC, READ COMMITTED) still apply."""
    server = make_url(mysql_url)
    url = database_url("default", {"default": {
        "ENGINE": "django.db.backends.mysql", "NAME": server.database,
        "USER": server.username, "PASSWORD": server.password or "",
        "HOST": server.host, "PORT": str(server.port or 3306),
        "OPTIONS": {"charset": "utf8mb4", "init_command": "SET @resilient_django = 'on'"}}})
    store = Store(url, "unused_")
    try:
        with store.engine.connect() as conn:
            row = conn.execute(text(
                "SELECT @resilient_django, @@character_set_client, @@time_zone, "
                "@@tx_isolation")).one()
            conn.rollback()
        assert tuple(row) == ("on", "utf8mb4", "+00:00", "READ-COMMITTED")
    finally:
        store.dispose()


def test_database_url_makes_relative_sqlite_paths_absolute(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = database_url("default", {"default": {"ENGINE": "django.db.backends.sqlite3",
                                               "NAME": "db.sqlite3"}})
    assert url == f"sqlite:///{tmp_path}/db.sqlite3"


@pytest.mark.parametrize(("db_settings", "why"), [
    ({"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}, "in-memory"),
    ({"ENGINE": "django.db.backends.oracle", "NAME": "shop"},
     "PostgreSQL, MySQL/MariaDB or SQLite"),
])
def test_database_url_refuses_what_the_store_cannot_use(
        db_settings: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigurationError, match=why) as err:
        database_url("default", {"default": db_settings})
    assert "CELERY_RESILIENT_STORE_URL" in str(err.value)
    with pytest.raises(ConfigurationError, match="no 'replica' entry"):
        database_url("replica", {"default": db_settings})


def test_check_passes_on_valid_settings() -> None:
    assert check_settings() == []


@pytest.mark.parametrize(("name", "value", "named"), [
    ("CELERY_RESILIENT_LEASE_SECOND", 10, "CELERY_RESILIENT_LEASE_SECOND"),
    ("CELERY_RESILIENT_MAX_ATTEMPTS", 0, "CELERY_RESILIENT_MAX_ATTEMPTS"),
])
def test_check_reports_unknown_and_invalid_settings(settings: Any, name: str, value: Any,
                                                    named: str) -> None:
    setattr(settings, name, value)
    errors = check_settings()
    assert [e.id for e in errors] == ["celery_resilient.E001"]
    assert named in errors[0].msg
    assert "'resilient_" not in errors[0].msg
