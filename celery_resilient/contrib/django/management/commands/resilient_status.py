"""``manage.py resilient_status``: work by state, open claims and their leases."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .....config import sanitize_url
from .....states import OPEN_STATES
from .....store import migrate as migrations
from .....store.sql import Store
from ...conf import store_config

MAX_OPEN = 50


class Command(BaseCommand):  # type: ignore[misc]
    help = "Show celery-resilient work by state, open claims with their leases, dead work."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json",
                            help="machine-readable output")

    def handle(self, *args: Any, as_json: bool = False, **options: Any) -> None:
        cfg = store_config()
        store = Store(cfg.store_url, cfg.table_prefix)
        try:
            data = _status(store)
        finally:
            store.dispose()
        data = {"store": sanitize_url(cfg.store_url), "table_prefix": cfg.table_prefix, **data}
        if as_json:
            self.stdout.write(json.dumps(data, indent=2))
            return
        self.stdout.write(f"store: {data['store']} (prefix {cfg.table_prefix}, schema "
                          f"{data['schema']['current'] or 'missing'}, head "
                          f"{data['schema']['head']})")
        if data["schema"]["current"] != data["schema"]["head"]:
            self.stdout.write("  schema is not current: run manage.py resilient_migrate")
            return
        for state, n in sorted(data["work"].items()):
            self.stdout.write(f"  {state:<9} {n}")
        for row in data["open"]:
            self.stdout.write(
                f"  {row['work_key']:<40} {row['state']:<9} {row['owner'] or '-':<30} "
                f"lease {row['lease_left_s']}s attempts {row['attempts']} "
                f"deaths {row['deaths']}")
        for row in data["dead"]:
            self.stdout.write(f"  DEAD {row['work_key']:<40} {row['error']}")


def _status(store: Store) -> dict[str, Any]:
    schema = migrations.describe(store.engine, store.prefix)
    if schema["current"] != schema["head"]:
        return {"schema": schema, "work": {}, "open": [], "dead": []}
    now = store.now()
    counts = store.count_by_state()
    open_rows = [w for s in OPEN_STATES for w in store.list_work(state=s, limit=MAX_OPEN)]
    open_rows.sort(key=lambda w: w.lease_expires_at or 0.0)
    dead = store.list_work(state="dead", limit=MAX_OPEN)
    return {
        "schema": schema,
        "work": counts,
        "open": [{"work_key": w.work_key, "state": w.state, "owner": w.owner_node,
                  "lease_left_s": None if w.lease_expires_at is None
                  else round(w.lease_expires_at - now, 1),
                  "attempts": w.attempts, "deaths": w.deaths} for w in open_rows[:MAX_OPEN]],
        "dead": [{"work_key": w.work_key, "error": w.error, "deaths": w.deaths}
                 for w in dead],
    }
