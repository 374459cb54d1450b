"""Django set up before a command reads the store's settings, as a worker has it."""

from __future__ import annotations

import os
import sys
from typing import Any

import click


def setup_django(app: Any) -> None:
    """Give a Celery app configured from Django's settings the store its worker uses.

    A worker sets Django up before it reads any setting (Celery's Django fixup calls
    ``django.setup()`` when it imports the task modules), and the Django app's ``ready()``
    then defaults the store to ``DATABASES["default"]`` (``configure_from_django``). A
    ``celery -A proj resilient`` command imports no task module, so without this it would
    read the settings before Django was set up and fall back to the SQLite file in the
    working directory. Both go through the same ``configure_from_django``.
    """
    if "django" not in sys.modules and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return
    try:  # optional dependency: only a Django project has it
        import django  # noqa: PLC0415
        from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415

        from celery_resilient.contrib.django.conf import (  # noqa: PLC0415
            configure_from_django,
            reads_django_settings,
        )
    except ImportError:
        return
    if not reads_django_settings(app):
        return
    try:
        django.setup()  # idempotent; runs the app config's ready()
    except ImproperlyConfigured as exc:
        raise click.ClickException(
            f"the Celery app reads Django's settings, but Django could not be set up: {exc}. "
            "Set DJANGO_SETTINGS_MODULE (as proj/celery.py usually does)") from None
    configure_from_django(app)


__all__ = ["setup_django"]
