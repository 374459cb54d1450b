"""Count this version's takes since each checkpoint, so a rolling deploy never skips work.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

During a rolling deploy across migration 0005, a worker of the previous version keeps its
checkpoints in ``<prefix>checkpoints`` and knows nothing of the work row's. Its
``checkpoint.clear()`` (or a ``self.replace`` that continues the work key) deletes only its
own row; the work row kept its checkpoint, and a worker of this version resumed the fresh run
from it, skipping what that checkpoint covered (lost work).

``checkpoint_takes`` counts the takes made by this version since the work row's checkpoint
was saved (a save sets it to 0, each take adds 1). Every take adds 1 to the epoch, so the
checkpoint was saved with no take of another version since exactly when ``epoch -
checkpoint_epoch == checkpoint_takes``. Only then is it resumed; otherwise the execution
resumes from the old table's row, which the other version's takes read and wrote, or from zero
if it cleared it. Either is never later than the last checkpoint any version saved, so work
handed between the versions is done again from an earlier point, never skipped. Existing rows
start at 0: a checkpoint copied by 0005 or saved before this revision counts as another
version's when a take followed it, and is then read from the old table, or not at all.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}work") as batch:
        batch.add_column(sa.Column("checkpoint_takes", sa.BigInteger, nullable=False,
                                   server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}work") as batch:
        batch.drop_column("checkpoint_takes")
