"""The Django app config: default store URL for the project's Celery app, settings check."""

from __future__ import annotations

import re
from typing import Any

from django.apps import AppConfig
from django.core import checks

from celery_resilient.contrib.django.checks import check_store_schema
from celery_resilient.contrib.django.conf import (
    configure_from_django,
    resilient_apps,
    settings_config,
)
from celery_resilient.contrib.django.testdb import follow_test_databases
from celery_resilient.errors import ConfigurationError

_SETTING_NAME = re.compile(r"\bresilient_([a-z0-9_]+)")


class CeleryResilientConfig(AppConfig):  # type: ignore[misc]
    name = "celery_resilient.contrib.django"
    label = "celery_resilient"
    verbose_name = "Celery resilient"

    def ready(self) -> None:
        # The usual layout imports proj/celery.py (Celery app + Resilient) from
        # proj/__init__.py, so the app exists by now; a later one can call
        # configure_from_django(app) itself.
        for app in resilient_apps():
            configure_from_django(app)
        follow_test_databases()
        checks.register(check_settings, "celery_resilient")
        checks.register(check_store_schema, "celery_resilient", checks.Tags.database)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """``manage.py check``: every ``CELERY_RESILIENT_*`` setting is known and valid.

    Celery itself does not reject unknown namespaced keys, so a misspelt one would otherwise
    be ignored silently.
    """
    try:
        settings_config()
    except ConfigurationError as exc:
        message = _SETTING_NAME.sub(lambda m: "CELERY_RESILIENT_" + m.group(1).upper(),
                                    str(exc))
        return [checks.Error(message, hint="See docs/django.md and docs/configuration.md.",
                             id="celery_resilient.E001")]
    return []
