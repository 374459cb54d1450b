"""A Django project laid out as docs/django.md says, run by real ``celery worker`` processes.

Only the subprocesses of ``test_real_worker.py`` import it (with ``DJANGO_SETTINGS_MODULE``
set in their environment alone); the database, table prefix and queue come from the test.
"""

from .celery import app as celery_app

__all__ = ("celery_app",)
