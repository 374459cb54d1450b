"""Alembic environment: runs on the connection and table prefix handed in by ``migrate.py``."""

from __future__ import annotations

from alembic import context

from celery_resilient.store.schema import build_tables

config = context.config
prefix: str = config.attributes["table_prefix"]
connection = config.attributes["connection"]

context.configure(
    connection=connection,
    target_metadata=build_tables(prefix).metadata,
    version_table=f"{prefix}alembic_version",
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
