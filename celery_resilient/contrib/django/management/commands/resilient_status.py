"""``manage.py resilient_status``: the same report, JSON and exit codes as
``celery -A proj resilient status`` (one implementation: ``celery_resilient.ops.reports``)."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from celery_resilient.contrib.django.conf import store_config
from celery_resilient.errors import ResilientError
from celery_resilient.ops.reports import render_status, status_report

MIGRATE_COMMAND = "python manage.py resilient_migrate"


class Command(BaseCommand):  # type: ignore[misc]
    # A bad CELERY_RESILIENT_* setting is this command's error, reported in its own form
    # (JSON with --json) and exit code, not as a system check failure before it runs.
    requires_system_checks: list[str] = []
    help = ("Show celery-resilient work by state, open claims with their leases, dead work, "
            "beat slots, contexts and workers; exits 1 when the schema is missing or old.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json",
                            help="machine-readable output (errors too)")

    def handle(self, *args: Any, as_json: bool = False, **options: Any) -> None:
        try:
            cfg = store_config()
        except ResilientError as exc:
            data, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        else:
            data, code = status_report(cfg, MIGRATE_COMMAND)
        if as_json:
            self.stdout.write(json.dumps(data, indent=2))
        elif not code:
            render_status(data, self.stdout.write, self.stderr.write)
        elif "store" in data:  # the error itself goes to stderr, as CommandError's
            self.stdout.write(f"store: {data['store']} (prefix {data['table_prefix']})")
        if code:
            raise CommandError(data["error"], returncode=code)
