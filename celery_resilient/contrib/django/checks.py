"""System checks that need the database: is the store's schema there and current?

Registered with Django's ``database`` tag, so it runs where Django runs its own database
checks: ``manage.py migrate`` and ``manage.py check --database default`` (a plain
``check``, ``runserver`` or a worker's start make no connection for it).
"""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from sqlalchemy.exc import SQLAlchemyError

from celery_resilient.contrib.django.conf import store_config
from celery_resilient.errors import ResilientError
from celery_resilient.ops.reports import describe_store
from celery_resilient.store import migrate as migrations
from celery_resilient.store.sql import Store

MIGRATE_COMMAND = "python manage.py resilient_migrate"


def check_store_schema(app_configs: Any = None, databases: Any = None,
                       **kwargs: Any) -> list[checks.CheckMessage]:
    """``celery_resilient.W001``: schema missing; ``W002``: schema at another revision;
    ``W003``: the store could not be read. Nothing when a worker creates the schema itself
    (``resilient_auto_migrate``, on by default for SQLite) or when no database is checked."""
    if not databases:
        return []
    try:
        cfg = store_config()
    except (ResilientError, ImproperlyConfigured):
        return []  # celery_resilient.E001 (check_settings) reports a bad setting
    if cfg.migrates_itself:
        return []
    where = describe_store(cfg)
    store = Store(cfg.store_url, cfg.table_prefix)
    try:
        info = migrations.describe(store.engine, cfg.table_prefix)
    except (ResilientError, SQLAlchemyError) as exc:
        return [checks.Warning(
            f"The celery-resilient store {where} could not be read to check its schema: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
            hint="Check CELERY_RESILIENT_STORE_URL (or DATABASES['default']).",
            id="celery_resilient.W003")]
    finally:
        store.dispose()
    if info["current"] == info["head"]:
        return []
    if info["current"] is None:
        return [checks.Warning(
            f"The celery-resilient store {where} has no schema: workers will refuse to start.",
            hint=f"Run `{MIGRATE_COMMAND}`.", id="celery_resilient.W001")]
    return [checks.Warning(
        f"The celery-resilient store {where} is at schema revision {info['current']}, "
        f"this version needs {info['head']}: workers will refuse to start.",
        hint=f"Run `{MIGRATE_COMMAND}`.", id="celery_resilient.W002")]
