"""Django integration: add ``"celery_resilient.contrib.django"`` to ``INSTALLED_APPS``.

Settings come through Celery's ``CELERY`` namespace (``CELERY_RESILIENT_STORE_URL`` ...);
without a store URL, the ``default`` entry of ``DATABASES`` is used. See ``docs/django.md``.
This module imports no model, so it is safe to import before Django is set up.
"""

from celery_resilient.contrib.django.conf import (
    SETTINGS_PREFIX,
    celery_app,
    configure_from_django,
    database_url,
    runtime,
)

__all__ = ["SETTINGS_PREFIX", "celery_app", "configure_from_django", "database_url", "runtime"]
