"""The epoch a replacement must supersede to take its work back.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

``self.replace(sig)`` hands the claim back for the signature Celery gives the task's id to.
A copy of the replaced request (a duplicate delivery, or the sweeper re-publishing the
stored message when the replacement took longer than the hold) used to take that claim and
run the replaced body again. ``handed_to`` names the epoch the replacement's message says it
supersedes: only that message takes the claim, copies of the replaced request are
duplicates, and the sweeper leaves the claim to the replacement. NULL: any message takes it.
A worker of the previous version ignores the column during a rolling deploy (it takes the
claim as before), and clears nothing: the next take of this version clears it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}work") as batch:
        batch.add_column(sa.Column("handed_to", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}work") as batch:
        batch.drop_column("handed_to")
