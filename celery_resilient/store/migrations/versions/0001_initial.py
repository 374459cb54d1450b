"""Initial schema: work, checkpoints, steps, ledger, schedule, contexts, workers.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_options, table_prefix
from celery_resilient.store.schema import LONG_TEXT, SECONDS

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = table_prefix()
    op.create_table(
        f"{p}work",
        sa.Column("work_key", sa.String(255), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("args_digest", sa.String(64), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("owner_node", sa.String(255), nullable=True),
        sa.Column("incarnation", sa.String(64), nullable=True),
        sa.Column("owner_pid", sa.Integer, nullable=True),
        sa.Column("lease_expires_at", SECONDS, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("deaths", sa.Integer, nullable=False),
        sa.Column("republished", sa.Integer, nullable=False),
        sa.Column("message_json", LONG_TEXT, nullable=True),
        sa.Column("result_json", LONG_TEXT, nullable=True),
        sa.Column("error", LONG_TEXT, nullable=True),
        sa.Column("created_at", SECONDS, nullable=False),
        sa.Column("updated_at", SECONDS, nullable=False),
        sa.Column("finished_at", SECONDS, nullable=True),
        **table_options(),
    )
    op.create_index(f"ix_{p}work_state_lease", f"{p}work", ["state", "lease_expires_at"])
    op.create_index(f"ix_{p}work_incarnation", f"{p}work", ["incarnation"])
    op.create_table(
        f"{p}checkpoints",
        sa.Column("work_key", sa.String(255), primary_key=True),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("state_json", LONG_TEXT, nullable=False),
        sa.Column("updated_at", SECONDS, nullable=False),
        **table_options(),
    )
    op.create_table(
        f"{p}steps",
        sa.Column("work_key", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("result_json", LONG_TEXT, nullable=False),
        sa.Column("created_at", SECONDS, nullable=False),
        sa.PrimaryKeyConstraint("work_key", "name", name=f"pk_{p}steps"),
        **table_options(),
    )
    op.create_table(
        f"{p}ledger",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("work_key", sa.String(255), nullable=True),
        sa.Column("epoch", sa.BigInteger, nullable=True),
        sa.Column("result_json", LONG_TEXT, nullable=False),
        sa.Column("applied_at", SECONDS, nullable=False),
        **table_options(),
    )
    op.create_table(
        f"{p}schedule_runs",
        sa.Column("entry", sa.String(255), nullable=False),
        sa.Column("slot", SECONDS, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("task_id", sa.String(255), nullable=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("claimed_at", SECONDS, nullable=False),
        sa.Column("sent_at", SECONDS, nullable=True),
        sa.PrimaryKeyConstraint("entry", "slot", name=f"pk_{p}schedule_runs"),
        **table_options(),
    )
    op.create_index(f"ix_{p}schedule_runs_state", f"{p}schedule_runs", ["state"])
    op.create_table(
        f"{p}schedule_markers",
        sa.Column("entry", sa.String(255), primary_key=True),
        sa.Column("last_slot", SECONDS, nullable=False),
        sa.Column("definition_json", LONG_TEXT, nullable=True),
        sa.Column("updated_at", SECONDS, nullable=False),
        **table_options(),
    )
    op.create_table(
        f"{p}contexts",
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("data_json", LONG_TEXT, nullable=False),
        sa.Column("updated_at", SECONDS, nullable=False),
        **table_options(),
    )
    op.create_index(f"ix_{p}contexts_updated_at", f"{p}contexts", ["updated_at"])
    op.create_table(
        f"{p}workers",
        sa.Column("incarnation", sa.String(64), primary_key=True),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", SECONDS, nullable=False),
        sa.Column("heartbeat_at", SECONDS, nullable=False),
        sa.Column("stopped_at", SECONDS, nullable=True),
        **table_options(),
    )
    op.create_index(f"ix_{p}workers_node", f"{p}workers", ["node"])


def downgrade() -> None:
    p = table_prefix()
    for name in ("workers", "contexts", "schedule_markers", "schedule_runs", "ledger", "steps",
                 "checkpoints", "work"):
        op.drop_table(f"{p}{name}")
