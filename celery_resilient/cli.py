"""``celery -A proj resilient <command>``: operate the store from Celery's own CLI."""

from __future__ import annotations

import json
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options

from .app import Resilient
from .config import sanitize_url
from .store import migrate as migrations


def _runtime(ctx: click.Context) -> Resilient:
    app = ctx.obj.app
    return Resilient.of(app)


@click.group(name="resilient", cls=click.Group)
@click.pass_context
@handle_preload_options  # type: ignore[untyped-decorator]
def resilient(ctx: click.Context) -> None:
    """celery-resilient: migrate the store, inspect claims."""


@resilient.command(cls=CeleryCommand)
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the store's schema to the current revision."""
    rt = _runtime(ctx)
    cfg = rt.config
    from .store.sql import Store

    store = Store(cfg.store_url, cfg.table_prefix)
    store.migrate()
    info = migrations.describe(store.engine, cfg.table_prefix)
    click.echo(f"schema of {sanitize_url(cfg.store_url)} (prefix {cfg.table_prefix}) "
               f"is at revision {info['current']}")


@resilient.command(cls=CeleryCommand)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Claims by state and the oldest open lease."""
    rt = _runtime(ctx)
    store = rt.store
    counts = store.count_by_state()
    now = store.now()
    open_rows = [w for w in store.list_work(limit=10_000)
                 if w.state in ("reserved", "running", "requeued")]
    data: dict[str, Any] = {
        "store": sanitize_url(rt.config.store_url),
        "work": counts,
        "open": [{"work_key": w.work_key, "state": w.state, "owner": w.owner_node,
                  "lease_left_s": None if w.lease_expires_at is None
                  else round(w.lease_expires_at - now, 1),
                  "attempts": w.attempts, "deaths": w.deaths} for w in open_rows[:50]],
    }
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"store: {data['store']}")
    for state, n in sorted(counts.items()):
        click.echo(f"  {state:<9} {n}")
    for row in data["open"]:
        click.echo(f"  {row['work_key']:<40} {row['state']:<9} {row['owner'] or '-':<30} "
                   f"lease {row['lease_left_s']}s deaths {row['deaths']}")
