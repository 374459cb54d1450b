"""Django settings of the contrib tests (applied by this folder's conftest only).

The store defaults to the ``default`` database (no ``CELERY_RESILIENT_STORE_URL``): the
test database pytest-django creates, named per test session so concurrent runs never share
one. The password is there to prove it is never logged (the server trusts local users).
"""

from __future__ import annotations

import os

SECRET_KEY = "celery-resilient-tests"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["testserver"]
#: The database the whole folder runs on: PostgreSQL, or MySQL/MariaDB when
#: RESILIENT_TEST_DJANGO_DB=mysql (scripts/test.sh runs the folder once more that way).
engine_under_test = os.environ.get("RESILIENT_TEST_DJANGO_DB", "postgresql")
if engine_under_test == "mysql":
    import pymysql  # Django's MySQL backend, through PyMySQL (the store's own driver)

    pymysql.install_as_MySQLdb()
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "NAME": "test",
            "USER": "resilient_django",  # made by this folder's conftest, with this password
            "PASSWORD": "s3cret-not-for-logs",
            "HOST": os.environ.get("RESILIENT_TEST_MYSQL_HOST", "127.0.0.1"),
            "PORT": "3306",
            "OPTIONS": {"charset": "utf8mb4"},
            "TEST": {"NAME": f"test_resilient_django_{os.getpid()}"},
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": "test",
            "USER": "postgres",
            "PASSWORD": "s3cret-not-for-logs",
            "HOST": os.environ.get("RESILIENT_TEST_PG_HOST", "127.0.0.1"),
            "PORT": "5432",
            "TEST": {"NAME": f"test_resilient_django_{os.getpid()}"},
        }
    }
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_resilient.contrib.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.contrib.django.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"

# Celery's namespace: config_from_object("django.conf:settings", namespace="CELERY").
CELERY_BROKER_URL = os.environ.get("RESILIENT_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESILIENT_TABLE_PREFIX = "djr_"
CELERY_RESILIENT_LEASE_SECONDS = 20
CELERY_RESILIENT_AUTO_MIGRATE = False  # the schema comes from manage.py resilient_migrate
RESILIENT_CELERY_APP = "tests.contrib.django.celeryapp:app"

#: What the store's URL derived from DATABASES looks like, for the tests' assertions.
store_driver = "mysql+pymysql" if engine_under_test == "mysql" else "postgresql+psycopg"
store_url_shown = (
    "mysql+pymysql://resilient_django:***@127.0.0.1:3306/test?charset=utf8mb4"
    if engine_under_test == "mysql" else "postgresql+psycopg://postgres:***@127.0.0.1:5432/test")

