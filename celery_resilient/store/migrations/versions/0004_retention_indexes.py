"""Indexes for automatic retention: each prune batch is found by an index range, never a scan.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07

On PostgreSQL ``CREATE INDEX`` blocks writes to its table while it builds (this migration
runs in one transaction, so it cannot build them ``CONCURRENTLY``): on a large store, run
``celery -A proj resilient migrate`` at a quiet moment.
"""

from __future__ import annotations

from alembic import op

from celery_resilient.store.migrate import table_prefix

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

#: (table, column) of each index, named ix_<prefix><table>_<column> as in store/schema.py.
INDEXES = (
    ("work", "finished_at"),
    ("ledger", "applied_at"),
    ("schedule_runs", "claimed_at"),
    ("workers", "heartbeat_at"),
    ("workers", "stopped_at"),
)


def upgrade() -> None:
    p = table_prefix()
    for table, column in INDEXES:
        op.create_index(f"ix_{p}{table}_{column}", f"{p}{table}", [column])


def downgrade() -> None:
    p = table_prefix()
    for table, column in reversed(INDEXES):
        op.drop_index(f"ix_{p}{table}_{column}", table_name=f"{p}{table}")
