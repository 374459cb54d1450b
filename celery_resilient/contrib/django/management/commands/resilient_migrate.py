"""``manage.py resilient_migrate``: create or upgrade the store's schema (its Alembic
migrations, not Django's: the admin's models are unmanaged)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from .....config import sanitize_url
from .....store import migrate as migrations
from .....store.sql import Store
from ...conf import store_config


class Command(BaseCommand):  # type: ignore[misc]
    help = "Create or upgrade the celery-resilient store's schema to the current revision."

    def handle(self, *args: Any, **options: Any) -> None:
        cfg = store_config()
        store = Store(cfg.store_url, cfg.table_prefix)
        try:
            before = migrations.current_revision(store.engine, cfg.table_prefix)
            store.migrate()
            info = migrations.describe(store.engine, cfg.table_prefix)
        finally:
            store.dispose()
        change = ("already current" if before == info["current"]
                  else f"upgraded from {before or 'nothing'}")
        self.stdout.write(
            f"schema of {sanitize_url(cfg.store_url)} (prefix {cfg.table_prefix}) is at "
            f"revision {info['current']} ({change})")
