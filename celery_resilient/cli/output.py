"""How the commands print: aligned tables, JSON on stdout, and errors as JSON under --json."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from celery_resilient.ops import reports


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ",
          err: bool = False) -> None:
    reports.rows(lambda line: click.echo(line, err=err), headers, rows, indent)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


@contextmanager
def json_errors(as_json: bool) -> Iterator[None]:
    """With ``--json``, errors too are JSON on stdout (``{"error": ...}``), same exit code."""
    try:
        yield
    except click.ClickException as exc:
        if not as_json:
            raise
        echo_json({"error": exc.format_message(), "exit_code": exc.exit_code})
        raise click.exceptions.Exit(exc.exit_code) from None


__all__ = ["echo_json", "json_errors", "table"]
