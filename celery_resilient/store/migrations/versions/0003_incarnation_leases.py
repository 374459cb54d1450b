"""One lease row per worker incarnation: lease, process identity, draining mark.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix
from celery_resilient.store.schema import SECONDS

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = table_prefix()
    with op.batch_alter_table(f"{p}workers") as batch:
        batch.add_column(sa.Column("lease_expires_at", SECONDS, nullable=True))
        batch.add_column(sa.Column("process", sa.String(255), nullable=True))
        batch.add_column(sa.Column("draining_at", SECONDS, nullable=True))


def downgrade() -> None:
    p = table_prefix()
    with op.batch_alter_table(f"{p}workers") as batch:
        batch.drop_column("draining_at")
        batch.drop_column("process")
        batch.drop_column("lease_expires_at")
