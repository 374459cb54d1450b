"""Free space in each page of the work table for its checkpoint saves (PostgreSQL).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07

A checkpoint save rewrites the work row and touches no indexed column, so PostgreSQL can
write the new version on the same page without an entry in any of the table's five indexes
(a HOT update), if the page has room. At the default fillfactor of 100 the rows, which carry
their message, fill every page, and a fifth to a third of the saves wrote all five indexes;
with a fifth of each page left free when rows are inserted, 95-100 % were HOT. The setting
applies to pages filled from now on (rows written after it, or a table rewrite).
"""

from __future__ import annotations

from alembic import op

from celery_resilient.store.migrate import table_prefix
from celery_resilient.store.schema import WORK_FILLFACTOR

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {table_prefix()}work SET (fillfactor = {WORK_FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {table_prefix()}work RESET (fillfactor)")
