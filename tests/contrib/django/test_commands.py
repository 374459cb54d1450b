"""``manage.py resilient_migrate`` and ``resilient_status`` on the real PostgreSQL."""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import pytest
from celery import Celery
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from sqlalchemy import inspect
from sqlalchemy.engine import make_url

from celery_resilient import Resilient
from celery_resilient.contrib.django.conf import settings_config
from celery_resilient.store import migrate as migrations
from celery_resilient.store.sql import Store
from celery_resilient.testing.services import drop_prefixed_tables

from . import helpers

PASSWORD = "s3cret-not-for-logs"


def _run(*args: str) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_migrate_creates_the_schema_under_the_configured_prefix(
        project_app: Celery, settings: Any) -> None:
    prefix = f"djm{uuid.uuid4().hex[:8]}_"
    settings.CELERY_RESILIENT_TABLE_PREFIX = prefix  # read when the app's config loads
    url = Resilient.of(project_app).config.store_url
    store = Store(url, prefix)
    try:
        with pytest.raises(CommandError, match=r"run `python manage\.py resilient_migrate`") as e:
            _run("resilient_status")
        assert e.value.returncode == 1 and "is missing" in str(e.value)

        first = _run("resilient_migrate")
        head = migrations.head_revision()
        assert f"prefix {prefix}) is at revision {head} (upgraded from nothing)" in first
        user = settings.DATABASES["default"]["USER"]
        assert PASSWORD not in first and f"{user}:***@" in first
        tables = set(inspect(store.engine).get_table_names())
        assert {f"{prefix}work", f"{prefix}steps", f"{prefix}contexts"} <= tables
        assert migrations.current_revision(store.engine, prefix) == head

        again = _run("resilient_migrate")
        assert "(already current)" in again
    finally:
        store.dispose()
        drop_prefixed_tables(url, prefix)


def test_status_shows_work_by_state_open_leases_and_dead_work(
        project_app: Celery, settings: Any) -> None:
    store = Resilient.of(project_app).store
    helpers.running(store, "job-running", "q-unused")
    helpers.dead(store, "job-dead", "q-unused")
    helpers.done(store, "job-done", "q-unused")

    data = json.loads(_run("resilient_status", "--json"))
    assert data["work"] == {"running": 1, "dead": 1, "done": 1}
    assert [r["work_key"] for r in data["open"]] == ["job-running"]
    assert data["open"][0]["owner"] == "live@host"
    assert 0 < data["open"][0]["lease_left_s"] <= 60
    assert data["dead"][0]["work_key"] == "job-dead"
    assert "died 1 times" in data["dead"][0]["error"]
    assert data["table_prefix"] == "djr_"
    assert make_url(data["store"]).database == connection.settings_dict["NAME"]
    assert PASSWORD not in json.dumps(data)

    text = _run("resilient_status")
    assert "job-dead" in text and "job-running" in text and PASSWORD not in text


def test_settings_alone_resolve_the_same_store(project_app: Celery) -> None:
    """Without a Celery app the commands read Django's settings the way Celery would."""
    alone = settings_config()
    assert alone == Resilient.of(project_app).config
