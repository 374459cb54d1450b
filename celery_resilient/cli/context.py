"""What every command takes from click's context: the app's runtime and a store whose
schema is checked, with the library's errors turned into clean CLI errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click
from sqlalchemy.exc import SQLAlchemyError

from celery_resilient.cli.django_setup import setup_django
from celery_resilient.errors import ResilientError
from celery_resilient.ops import reports
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.sql import Store

T = TypeVar("T")


def runtime(ctx: click.Context) -> Runtime:
    """The runtime of the ``-A`` app, its settings resolved here: a bad setting is a usage
    error of this command."""
    app = ctx.obj.app
    try:
        setup_django(app)
        rt = Runtime.of(app)
        _ = rt.config
    except ResilientError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    return rt


def store(ctx: click.Context, as_json: bool = False) -> tuple[Runtime, Store]:
    """The app's store with its schema checked, created or upgraded only where a worker
    would do it itself (``resilient_auto_migrate``; SQLite stores by default).

    Disposed when the command ends. Human output starts with the store's name (JSON
    carries a ``store`` key instead).
    """
    rt = runtime(ctx)
    try:
        checked = _checked(rt.config)
    except ResilientError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
    except SQLAlchemyError as exc:
        raise click.ClickException(
            f"the store {reports.describe_store(rt.config)} is unreachable: {exc}") from None
    ctx.call_on_close(checked.dispose)
    if not as_json:
        click.echo(f"store: {reports.describe_store(rt.config)}")
    return rt, checked


def _checked(cfg: ResilientConfig) -> Store:
    """A store for ``cfg`` whose schema is current; migrated exactly when a worker would."""
    checked = Store(cfg.store_url, cfg.table_prefix)
    try:
        checked.ensure_schema(migrate_if_needed=cfg.migrates_itself)
    except BaseException:
        checked.dispose()
        raise
    return checked


def run(fn: Callable[[], T]) -> T:
    """Turn the library's errors (store down, bad schema) into a clean CLI error."""
    try:
        return fn()
    except ResilientError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from None


__all__ = ["run", "runtime", "store"]
