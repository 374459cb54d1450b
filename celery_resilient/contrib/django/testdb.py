"""The store follows Django's test database under Django's test runner and pytest-django.

Both runners create ``test_<name>`` after Django is set up and switch
``DATABASES[alias]["NAME"]`` to it; the project's Celery app has often loaded its
configuration before that, with the store URL derived from the real database. When Django
first connects to the test database (``connection_created``, in a test environment only:
``setup_test_environment()`` has run), this module:

- creates the store's schema in the test database (its own migrations, as
  ``manage.py resilient_migrate`` does; Django's migrations never create the store's tables)
  and empties the store there (``--keepdb`` keeps a database from one run to the next);
- points every configured Celery app whose store is the real database at the test database
  (dropping its runtime's engine), and gives every Celery app configured from Django but not
  yet loaded the test database as its default (an explicit store URL still wins);
- an in-memory SQLite test database, which the store cannot open, is replaced by a
  temporary SQLite file for this test run.

The store writes through its own connection, not Django's: ``TestCase``'s rollback and
``TransactionTestCase``'s flush do not cover its rows. Isolation is per test run (a fresh,
empty store in the test database, dropped with it); :func:`empty_store` or
:class:`StoreIsolationMixin` empties it after each test. Before Django opens a server-level
connection (to create or drop a test database) the store's pooled connections are closed,
so they never block ``DROP DATABASE``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from typing import Any

from celery._state import _get_active_apps
from django.conf import settings
from django.core import mail
from django.db import DEFAULT_DB_ALIAS
from django.db.backends.base.base import NO_DB_ALIAS
from django.db.backends.signals import connection_created

from celery_resilient.contrib.django.conf import _CONFIGURED, database_url, table_prefix
from celery_resilient.errors import ConfigurationError
from celery_resilient.runtime.config import PREFIX
from celery_resilient.runtime.runtime import STORE_URL_FILTERS, Runtime
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.sql import Store
from celery_resilient.testing.stores import empty_store as _empty
from celery_resilient.testing.stores import forget_store, use_store
from celery_resilient.testing.stores import table_prefix as app_table_prefix

log = logging.getLogger(__name__)
_URL_KEY = PREFIX + "store_url"
_real: dict[str, str] = {}  # alias -> store URL of the real database, taken at setup
_test: dict[str, str] = {}  # alias -> store URL in the test database, once prepared
_tmp: dict[str, str] = {}  # alias -> temporary SQLite URL for an in-memory test database
_prepared: set[tuple[str, str]] = set()  # (store URL, table prefix) migrated and emptied
_DEFAULTED = "_celery_resilient_test_default"
_NO_TEST_DATABASE = "(no test database)"


def follow_test_databases() -> None:
    """Remember the real databases' store URLs and follow test databases from now on."""
    for alias in settings.DATABASES:
        if alias in _real:  # taken once, before any test database replaced the real one
            continue
        try:
            _real[alias] = database_url(alias)
        except ConfigurationError:
            if _in_memory(alias):
                _real[alias] = ""  # nothing real to protect; its test database is followed
    connection_created.connect(_on_connection_created, weak=False,
                               dispatch_uid="celery_resilient.testdb")
    if _keep_off_real_databases not in STORE_URL_FILTERS:
        STORE_URL_FILTERS.append(_keep_off_real_databases)


def _keep_off_real_databases(rt: Runtime, url: str) -> str:
    """In a test environment a store is never opened on a real database: on the test
    database that replaced it, or, before any is connected (a ``SimpleTestCase``, a
    pytest-django test without ``db``), on a temporary SQLite store for the run."""
    if not url or not in_test_environment():
        return url
    aliases = [alias for alias, real in _real.items() if real == url]
    if not aliases:
        return url
    if aliases[0] in _test:
        target = _test[aliases[0]]
        _prepare(target, rt.config.table_prefix)
        return target
    if _NO_TEST_DATABASE not in _tmp:
        folder = tempfile.mkdtemp(prefix="celery-resilient-test-")
        atexit.register(shutil.rmtree, folder, True)
        _tmp[_NO_TEST_DATABASE] = f"sqlite:///{os.path.join(folder, 'store.sqlite3')}"
        log.info("celery-resilient: a test uses the store before any test database is "
                 "connected; it gets a temporary SQLite store instead of the real database",
                 extra={"action": "config_test_database"})
    target = _tmp[_NO_TEST_DATABASE]
    _prepare(target, rt.config.table_prefix)
    return target


def in_test_environment() -> bool:
    """Whether ``django.test.utils.setup_test_environment()`` is in effect."""
    return hasattr(mail, "outbox")


def test_store_url(alias: str = DEFAULT_DB_ALIAS) -> str:
    """The store URL for Django's current ``alias`` database, in-memory SQLite included."""
    try:
        return database_url(alias)
    except ConfigurationError:
        if not _in_memory(alias):
            raise
    if alias not in _tmp:
        folder = tempfile.mkdtemp(prefix="celery-resilient-test-")
        atexit.register(shutil.rmtree, folder, True)
        _tmp[alias] = f"sqlite:///{os.path.join(folder, 'store.sqlite3')}"
    return _tmp[alias]


def _in_memory(alias: str) -> bool:
    db = settings.DATABASES[alias]
    name = str(db.get("NAME") or "")
    return "sqlite" in str(db.get("ENGINE", "")) and (
        name in ("", ":memory:") or "mode=memory" in name)


def _on_connection_created(sender: Any = None, connection: Any = None, **_: Any) -> None:
    alias = getattr(connection, "alias", None)
    if alias == NO_DB_ALIAS:  # creating or dropping a database: release the store's
        for app in _django_apps():
            rt = Runtime.enabled_on(app)
            if rt is not None and app.configured and app.conf.get(_URL_KEY) in _test.values():
                forget_store(rt)
        return
    if alias not in _real or not in_test_environment():
        return
    target = test_store_url(alias)
    if target == _real[alias]:
        return  # not (or no longer) a test database: never repoint the real one
    previous = _test.get(alias)  # a parallel test process inherits its parent's database
    if previous != target:
        _test[alias] = target
        log.info("celery-resilient: the store follows Django's test database %r: %s", alias,
                 sanitize_url(target), extra={"action": "config_test_database"})
    _prepare(target, table_prefix())
    for app in _django_apps():
        if not app.configured:
            if getattr(app, _DEFAULTED, None) != target:
                setattr(app, _DEFAULTED, target)
                app.add_defaults({_URL_KEY: target})  # explicit settings still win
        elif app.conf.get(_URL_KEY) != target and app.conf.get(_URL_KEY) in (
                _real[alias], previous):
            # the real database, or the parent's test database in a parallel test process
            # (``manage.py test --parallel``: each process has a clone of its own)
            use_store(app, target, migrate=False)
            _prepare(target, app_table_prefix(app))


def _prepare(url: str, prefix: str) -> None:
    """Once per run: the store's schema in the test database, and no rows left from an
    earlier run (``--keepdb``)."""
    if (url, prefix) in _prepared:
        return
    store = Store(url, prefix)
    try:
        store.migrate()
        _empty(store)
    finally:
        store.dispose()
    _prepared.add((url, prefix))


def _django_apps() -> list[Any]:
    return [a for a in list(_get_active_apps())
            if Runtime.enabled_on(a) is not None and getattr(a, _CONFIGURED, False)]


def empty_store(alias: str = DEFAULT_DB_ALIAS) -> None:
    """Delete every store row in the test database ``alias`` (only there)."""
    url = _test.get(alias)
    if url is None:
        raise ConfigurationError(
            f"no test database {alias!r} is in use: empty_store() only empties the store "
            "that follows Django's test database")
    store = Store(url, table_prefix())
    try:
        _empty(store)
    finally:
        store.dispose()


class StoreIsolationMixin:
    """Mix into a Django ``TestCase`` before it: the store is emptied after each test.

    ``class ImportTests(StoreIsolationMixin, TestCase): ...``. The store's writes are not in
    Django's test transaction, so its rollback alone would leave them for the next test.
    """

    def setUp(self) -> None:
        super().setUp()  # type: ignore[misc]
        self.addCleanup(empty_store)  # type: ignore[attr-defined]
