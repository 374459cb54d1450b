"""The broker each worker incarnation consumes from.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

Every worker re-publishes the work its store holds into its own broker, so two apps on
different brokers sharing one store and table prefix would send each other's work where
nobody consumes it. A worker records its broker here and refuses to start beside a live
incarnation on another one. NULL: a worker of an earlier version, which is not judged.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix
from celery_resilient.store.schema import LONG_TEXT

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}workers") as batch:
        batch.add_column(sa.Column("broker", LONG_TEXT, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}workers") as batch:
        batch.drop_column("broker")
