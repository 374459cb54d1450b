"""``migrate``: the store's schema, the same report as Django's ``resilient_migrate``."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from celery_resilient.cli import context
from celery_resilient.cli.options import option_json
from celery_resilient.cli.output import echo_json, json_errors
from celery_resilient.ops import reports


@click.command(cls=CeleryCommand)
@option_json
@click.pass_context
def migrate(ctx: click.Context, as_json: bool) -> None:
    """Create or upgrade the store's schema to the current revision."""
    with json_errors(as_json):
        rt = context.runtime(ctx)
        data, code = reports.migrate_report(rt.config)
        if code and not as_json:
            raise click.ClickException(data["error"])
    echo_json(data) if as_json else click.echo(reports.migrate_text(data))
    if code:
        ctx.exit(code)


__all__ = ["migrate"]
