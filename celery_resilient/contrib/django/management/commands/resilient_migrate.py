"""``manage.py resilient_migrate``: create or upgrade the store's schema (its Alembic
migrations, not Django's: the admin's models are unmanaged). The same implementation as
``celery -A proj resilient migrate``."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_resilient.contrib.django.conf import store_config
from celery_resilient.errors import ResilientError
from celery_resilient.ops.reports import migrate_report, migrate_text


class Command(BaseCommand):  # type: ignore[misc]
    # A bad CELERY_RESILIENT_* setting is this command's error, reported in its own form
    # (JSON with --json) and exit code, not as a system check failure before it runs.
    requires_system_checks: list[str] = []
    help = "Create or upgrade the celery-resilient store's schema to the current revision."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json",
                            help="machine-readable output (errors too)")

    def handle(self, *args: Any, as_json: bool = False, **options: Any) -> None:
        try:
            cfg = store_config()
        except ResilientError as exc:
            data, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        else:
            data, code = migrate_report(cfg)
        if as_json:
            self.stdout.write(json.dumps(data, indent=2))
        if code:
            raise CommandError(data["error"], returncode=code)
        if not as_json:
            self.stdout.write(migrate_text(data))
