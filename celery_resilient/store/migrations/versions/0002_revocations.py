"""Revoked task ids outlive the workers' memory; work is found by task id; retry generation;
forgotten work's last epoch.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_options, table_prefix
from celery_resilient.store.schema import SECONDS

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = table_prefix()
    op.create_table(
        f"{p}revocations",
        sa.Column("task_id", sa.String(255), primary_key=True),
        sa.Column("created_at", SECONDS, nullable=False),
        **table_options(),
    )
    op.create_index(f"ix_{p}revocations_created_at", f"{p}revocations", ["created_at"])
    op.create_index(f"ix_{p}work_task_id", f"{p}work", ["task_id"])
    op.create_table(
        f"{p}forgotten",
        sa.Column("work_key", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("forgotten_at", SECONDS, nullable=False),
        **table_options(),
    )
    op.create_index(f"ix_{p}forgotten_forgotten_at", f"{p}forgotten", ["forgotten_at"])
    with op.batch_alter_table(f"{p}work") as batch:
        batch.add_column(sa.Column("retries", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    p = table_prefix()
    with op.batch_alter_table(f"{p}work") as batch:
        batch.drop_column("retries")
    op.drop_index(f"ix_{p}forgotten_forgotten_at", table_name=f"{p}forgotten")
    op.drop_table(f"{p}forgotten")
    op.drop_index(f"ix_{p}work_task_id", table_name=f"{p}work")
    op.drop_index(f"ix_{p}revocations_created_at", table_name=f"{p}revocations")
    op.drop_table(f"{p}revocations")
