"""Settings glue between Django, Celery and the store.

Celery's usual Django setup, ``app.config_from_object("django.conf:settings",
namespace="CELERY")``, already maps ``CELERY_RESILIENT_STORE_URL`` to
``resilient_store_url`` (and so on for every setting): nothing here re-implements that. What
this module adds is the default store URL, taken from ``DATABASES`` when no store URL is set,
filled in when the Celery app's configuration is loaded (``on_after_configure``) and only if
nothing else set one.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery._state import _get_active_apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from sqlalchemy.engine import URL

from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.config import PREFIX, ResilientConfig
from celery_resilient.runtime.runtime import _ATTR, Runtime
from celery_resilient.store.engine import sanitize_url

log = logging.getLogger(__name__)

SETTINGS_PREFIX = "CELERY_" + PREFIX.upper()  # CELERY_RESILIENT_
CELERY_APP_SETTING = "RESILIENT_CELERY_APP"  # outside the CELERY namespace on purpose
_CONFIGURED = "_celery_resilient_django"
_POSTGRES_ENGINES = ("django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis")
_SQLITE_ENGINES = ("django.db.backends.sqlite3", "django.contrib.gis.db.backends.spatialite")
_MYSQL_ENGINES = ("django.db.backends.mysql", "django.contrib.gis.db.backends.mysql")
# MySQL connection OPTIONS carried to PyMySQL (strings and numbers only); Django's own
# ``isolation_level`` is not (the store chooses READ COMMITTED: store/engine.py).
_MYSQL_OPTIONS = ("charset", "init_command", "connect_timeout", "read_timeout",
                  "write_timeout", "read_default_file", "read_default_group", "local_infile")
# Keys of OPTIONS["ssl"] (MySQLdb's form), as SQLAlchemy's MySQL URL query names them.
_MYSQL_SSL = {"ca": "ssl_ca", "cert": "ssl_cert", "key": "ssl_key", "capath": "ssl_capath",
              "cipher": "ssl_cipher", "check_hostname": "ssl_check_hostname"}
# libpq connection parameters that may be carried over from OPTIONS (strings only).
_LIBPQ_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword",
                  "connect_timeout", "application_name", "options", "target_session_attrs",
                  "passfile", "service")


def database_url(alias: str = "default",
                 databases: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """The SQLAlchemy URL of Django's database ``alias`` (PostgreSQL, MySQL or SQLite).

    PostgreSQL becomes ``postgresql+psycopg://`` (psycopg 3, the ``postgres`` extra) with
    the string-valued libpq ``OPTIONS``; MySQL/MariaDB becomes ``mysql+pymysql://`` (the
    ``mysql`` extra; ``mysql+mysqldb://`` where only mysqlclient is installed) with its
    ``charset``, ``init_command``, ``ssl`` and other connection ``OPTIONS``; SQLite becomes
    ``sqlite:///<absolute path>``. An in-memory SQLite database or another engine raises
    :class:`ConfigurationError`: set ``CELERY_RESILIENT_STORE_URL`` then. The returned URL
    holds the password: log it only through :func:`celery_resilient.store.engine.sanitize_url`.
    """
    dbs = settings.DATABASES if databases is None else databases
    if alias not in dbs:
        raise ConfigurationError(
            f"DATABASES has no {alias!r} entry to default the celery-resilient store to; "
            f"set {SETTINGS_PREFIX}STORE_URL")
    db = dbs[alias]
    engine = str(db.get("ENGINE", ""))
    name = db.get("NAME")
    if engine in _SQLITE_ENGINES:
        path = str(name or "")
        if not path or path == ":memory:" or "mode=memory" in path:
            raise ConfigurationError(
                f"DATABASES[{alias!r}] is an in-memory SQLite database, which other processes "
                f"cannot share; set {SETTINGS_PREFIX}STORE_URL to a file or server database")
        return f"sqlite:///{os.path.abspath(path)}"
    if engine in _POSTGRES_ENGINES:
        options = db.get("OPTIONS") or {}
        query = {k: str(options[k]) for k in _LIBPQ_OPTIONS
                 if isinstance(options.get(k), (str, int)) and not isinstance(options[k], bool)}
        port = db.get("PORT")
        host = str(db.get("HOST") or "") or None
        if host is not None and host.startswith("/"):  # a Unix socket directory (libpq's host)
            query["host"] = host
            host = None
        url = URL.create(
            "postgresql+psycopg",
            username=db.get("USER") or None,
            password=db.get("PASSWORD") or None,
            host=host,
            port=int(port) if port not in (None, "") else None,
            database=str(name) if name else None,
            query=query,
        )
        return url.render_as_string(hide_password=False)
    if engine in _MYSQL_ENGINES:
        return _mysql_url(db)
    raise ConfigurationError(
        f"DATABASES[{alias!r}] uses {engine or 'no ENGINE'}; the celery-resilient store runs on "
        f"PostgreSQL, MySQL/MariaDB or SQLite: set {SETTINGS_PREFIX}STORE_URL")


def _mysql_driver() -> str:
    """PyMySQL when installed (the ``mysql`` extra); otherwise mysqlclient, Django's own
    default driver, when that is what the project has (``mysql+mysqldb://``)."""
    if importlib.util.find_spec("pymysql") is None and importlib.util.find_spec("MySQLdb"):
        return "mysql+mysqldb"
    return "mysql+pymysql"


def _mysql_url(db: Mapping[str, Any]) -> str:
    """``mysql+pymysql://`` (or ``mysql+mysqldb://``: :func:`_mysql_driver`) for a Django
    MySQL database, its connection OPTIONS carried."""
    options = db.get("OPTIONS") or {}
    query: dict[str, str] = {}
    for k in _MYSQL_OPTIONS:
        value = options.get(k)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            query[k] = str(value)
    ssl = options.get("ssl")
    if isinstance(ssl, Mapping):
        for k, name in _MYSQL_SSL.items():
            if ssl.get(k) not in (None, ""):
                query[name] = str(ssl[k]).lower() if isinstance(ssl[k], bool) else str(ssl[k])
    host = str(db.get("HOST") or "") or None
    if host is not None and host.startswith("/"):  # a Unix socket path (Django's form)
        query["unix_socket"] = host
        host = None
    port = db.get("PORT")
    database = db.get("NAME")
    url = URL.create(
        _mysql_driver(),
        username=db.get("USER") or None,
        password=db.get("PASSWORD") or None,
        host=host,
        port=int(port) if port not in (None, "") else None,
        database=str(database) if database else None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def configure_from_django(app: Celery, alias: str = "default") -> None:
    """Default ``app``'s store to Django's database ``alias`` when it sets no store URL.

    Idempotent. Lazy: applied when the Celery configuration is loaded (Celery's
    ``on_after_configure``), so ``DATABASES`` is read then (a test database created in
    between is the one used), and only when no ``resilient_store_url`` came from anywhere
    (``CELERY_RESILIENT_STORE_URL``, ``app.conf``): an explicit store URL always wins. Call
    it before the app's resilient settings are first used; the app config does this for the
    Celery apps that read Django's settings.
    """
    if getattr(app, _CONFIGURED, False):
        return
    setattr(app, _CONFIGURED, True)

    def apply(conf: Any) -> None:
        if conf.get(PREFIX + "store_url"):
            return
        url = database_url(alias)
        conf[PREFIX + "store_url"] = url
        log.info("celery-resilient: store defaults to Django's %r database: %s", alias,
                 sanitize_url(url), extra={"action": "config_default"})

    if app.configured:
        apply(app.conf)
    else:
        def on_after_configure(sender: Any = None, source: Any = None, **_: Any) -> None:
            apply(source)

        app.on_after_configure.connect(on_after_configure, weak=False)


def reads_django_settings(app: Celery) -> bool:
    """Whether ``app`` was configured with ``config_from_object`` on Django's settings."""
    source = getattr(app, "_config_source", None)  # set by Celery's config_from_object
    return source == "django.conf:settings" or source is settings


def resilient_apps() -> list[Celery]:
    """Live Celery apps with ``Resilient`` applied whose settings come from Django."""
    return [a for a in list(_get_active_apps())
            if getattr(a, _ATTR, None) is not None and reads_django_settings(a)]


def celery_app() -> Celery:
    """The project's Celery app: ``settings.RESILIENT_CELERY_APP`` or the one found.

    ``RESILIENT_CELERY_APP`` is a ``"module:attribute"`` path (``"proj.celery:app"``).
    Without it, the single live Celery app with ``Resilient`` applied that reads Django's
    settings is used.
    """
    path = getattr(settings, CELERY_APP_SETTING, None)
    if path:
        module, _, attr = str(path).partition(":")
        found = getattr(importlib.import_module(module), attr or "app")
        if not isinstance(found, Celery):
            raise ImproperlyConfigured(f"{CELERY_APP_SETTING}={path!r} is not a Celery app")
        configure_from_django(found)
        return found
    apps = resilient_apps()
    if len(apps) == 1:
        return apps[0]
    why = "none is loaded" if not apps else f"{len(apps)} are loaded"
    raise ImproperlyConfigured(
        "celery-resilient needs the project's Celery app (with Resilient(app) applied and "
        f"config_from_object('django.conf:settings', namespace='CELERY')) but {why}; set "
        f"{CELERY_APP_SETTING} = 'proj.celery:app'")


def runtime() -> Runtime:
    """The ``Resilient`` runtime of the project's Celery app."""
    return Runtime.of(celery_app())


def settings_mapping() -> dict[str, Any]:
    """``resilient_*`` settings as the CELERY namespace maps them from Django's settings."""
    return {"resilient_" + name[len(SETTINGS_PREFIX):].lower(): getattr(settings, name)
            for name in dir(settings) if name.startswith(SETTINGS_PREFIX)}


def settings_config() -> ResilientConfig:
    """The resolved settings from Django's settings alone (no Celery app needed)."""
    mapping = settings_mapping()
    if mapping.get(PREFIX + "store_url") is None:
        mapping[PREFIX + "store_url"] = database_url()
    return ResilientConfig.from_mapping(mapping)


def store_config() -> ResilientConfig:
    """The project's Celery app's settings, or Django's settings alone when none is found."""
    try:
        app = celery_app()
    except ImproperlyConfigured:
        if getattr(settings, CELERY_APP_SETTING, None):
            raise
        return settings_config()
    return Runtime.of(app).config


def table_prefix() -> str:
    """The store's table prefix, as the admin's models map it."""
    value = getattr(settings, SETTINGS_PREFIX + "TABLE_PREFIX", None)
    return str(value) if value else "resilient_"
