"""Point a Celery app's store somewhere else for a test, and empty a store between tests.

Used by the ``resilient_store`` pytest fixture and by the Django integration's test-database
support (``celery_resilient.contrib.django.testdb``). Tasks applied eagerly or with
``.apply()`` write through the app's runtime, so switching the store means forgetting the
runtime's resolved settings and its engine; the next use re-reads ``app.conf``.
"""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery

from celery_resilient.runtime.config import PREFIX
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.sql import Store

_URL_KEY = PREFIX + "store_url"


def use_store(app: Celery, url: str, *, migrate: bool = True) -> Callable[[], None]:
    """Make ``app`` use the store at ``url`` from now on; returns a function undoing it.

    With ``migrate`` the store's schema is created or upgraded first, whatever
    ``resilient_auto_migrate`` says (a test database starts without it).
    """
    rt = Runtime.of(app)
    previous = app.conf.get(_URL_KEY)
    app.conf[_URL_KEY] = url
    forget_store(rt)
    if migrate:
        store = Store(url, table_prefix(app))
        try:
            store.migrate()
        finally:
            store.dispose()

    def restore() -> None:
        forget_store(rt)
        app.conf[_URL_KEY] = previous  # None reads as unset

    return restore


def table_prefix(app: Celery) -> str:
    """The app's table prefix, read without resolving (and validating) all its settings."""
    return str(app.conf.get(PREFIX + "table_prefix") or "resilient_")


def forget_store(rt: Runtime) -> None:
    """Close the runtime's engine and drop its resolved settings: re-read at the next use."""
    rt.forget_store()


def empty_store(store: Store) -> None:
    """Delete every row of the store's tables (its schema stays)."""
    with store.begin() as conn:
        for table in reversed(store.t.metadata.sorted_tables):
            conn.execute(table.delete())
