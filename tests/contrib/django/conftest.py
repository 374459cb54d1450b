"""pytest-django for this folder only.

Django is configured here, when this folder is collected, with ``settings.configure`` and
not ``DJANGO_SETTINGS_MODULE``: the environment variable would reach every ``celery worker``
the rest of the suite starts and switch on Celery's Django fixup there. Without settings,
pytest-django stays inert for the other tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import django
import pytest
from celery import Celery
from django.conf import settings
from django.core.management import call_command
from sqlalchemy import create_engine, text

from celery_resilient import Resilient
from celery_resilient.contrib.django import configure_from_django

from . import celeryapp
from . import settings as test_settings


def _mysql_user() -> None:
    """The password-protected account the MySQL settings name (a password proves it is never
    logged; the machine's root has none): allowed to create the per-session test database."""
    db = test_settings.DATABASES["default"]
    engine = create_engine(f"mysql+pymysql://root@{db['HOST']}:{db['PORT']}/")
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE USER IF NOT EXISTS '{db['USER']}'@'%' "
                              f"IDENTIFIED BY '{db['PASSWORD']}'"))
            conn.execute(text(f"GRANT ALL PRIVILEGES ON *.* TO '{db['USER']}'@'%'"))
    finally:
        engine.dispose()


if not settings.configured:
    if test_settings.engine_under_test == "mysql":
        _mysql_user()
    settings.configure(**{k: getattr(test_settings, k) for k in dir(test_settings)
                          if k.isupper()})
    django.setup()


@pytest.fixture(scope="session")
def resilient_schema(django_db_setup: Any, django_db_blocker: Any) -> None:
    """The store's schema in the test database, made by the management command."""
    app = Celery("djproj-migrate", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    Resilient(app)
    configure_from_django(app)
    celeryapp.app = app
    try:
        with django_db_blocker.unblock():
            call_command("resilient_migrate")
    finally:
        celeryapp.app = None
        app.close()


@pytest.fixture
def project_app(resilient_schema: None, db: Any,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    """The project's Celery app, made the usual Django way, with Resilient applied."""
    app = Celery(f"djproj-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    rt = Resilient(app)
    configure_from_django(app)  # made after Django's setup: ready() has not seen it
    monkeypatch.setattr(celeryapp, "app", app)
    yield app
    if rt._store is not None:
        try:
            _empty(rt)
        finally:
            rt._store.dispose()  # before pytest-django drops the test database
    app.close()


def _empty(rt: Resilient) -> None:
    """The store writes outside Django's test transaction: clear its rows after each test."""
    t = rt.store.t
    with rt.store.begin() as conn:
        for table in (t.work, t.steps, t.ledger, t.schedule_runs,
                      t.schedule_markers, t.contexts, t.workers, t.revocations,
                      t.forgotten):
            conn.execute(table.delete())
