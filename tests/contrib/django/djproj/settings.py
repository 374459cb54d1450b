"""The project's settings: the store is ``DATABASES["default"]`` (no store URL is set).

``DJPROJ_DB_NAME`` is the test database pytest-django made, ``DJPROJ_TABLE_PREFIX`` and
``DJPROJ_QUEUE`` keep one test's tables and messages apart from every other run.
``DJPROJ_DB_ENGINE=mysql``: the same project on Django's MySQL backend (MariaDB here, through
PyMySQL's mysqlclient shim), its database named by ``DJPROJ_DB_NAME`` too.
"""

from __future__ import annotations

import os

from tests.contrib.django.settings import *  # noqa: F403

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("DJPROJ_DB_NAME", "test"),
        "USER": "postgres",
        "PASSWORD": "s3cret-not-for-logs",
        "HOST": os.environ.get("RESILIENT_TEST_PG_HOST", "127.0.0.1"),
        "PORT": "5432",
    }
}
CELERY_RESILIENT_TABLE_PREFIX = os.environ.get("DJPROJ_TABLE_PREFIX", "djproj_")
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("DJPROJ_QUEUE", "djproj")
CELERY_RESILIENT_LEASE_SECONDS = 6
CELERY_RESILIENT_HEARTBEAT_INTERVAL = 1
CELERY_RESILIENT_SWEEP_INTERVAL = 1
RESILIENT_CELERY_APP = "tests.contrib.django.djproj.celery:app"

if os.environ.get("DJPROJ_DB_ENGINE") == "mysql":
    import pymysql

    pymysql.install_as_MySQLdb()
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": os.environ["DJPROJ_DB_NAME"],
            "USER": os.environ.get("DJPROJ_MYSQL_USER", "root"),
            "PASSWORD": os.environ.get("DJPROJ_MYSQL_PASSWORD", ""),
            "HOST": os.environ.get("DJPROJ_MYSQL_HOST", "127.0.0.1"),
            "PORT": os.environ.get("DJPROJ_MYSQL_PORT", "3306"),
        }
    }
