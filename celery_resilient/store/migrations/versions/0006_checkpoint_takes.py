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
was saved (a save sets it to 0, each take adds 1). Every take adds 1 to the epoch, so no take
of another version came after the save exactly when ``epoch - checkpoint_epoch ==
checkpoint_takes``; only then is the work row's checkpoint resumed. Otherwise the execution
resumes from the old table's row, which the other version read and wrote, or from zero if it
cleared it: never later than the last checkpoint any version saved, so work handed between
the versions is done again from an earlier point, never skipped.

NULL marks a checkpoint of open work whose old-table row was saved in the same claim or a
later one (``epoch >= checkpoint_epoch``): 0005's copy, or a save of an old worker after the
copy. The old worker running that work may still save or clear there after the migration,
within the same epoch, so the old row stays the one resumed (otherwise the copy would be
resumed after such a clear). A 0005 worker's save always has a later epoch than any
old row, so it is not marked. Both run in the migration's transaction, behind 0005's and this
revision's ``ALTER TABLE`` of the work table, which every write of the previous version
waits for (each touches the work row), so no change to the old table falls between the copy
and the mark. A checkpoint of open work saved by a 0005 worker gets the takes since its save
counted as this version's (0005 workers read and cleared the work row as this one does).
Not repaired: on a store migrated to 0005 by a development build while old workers ran, an
old worker's clear made before this revision left no old row to compare with, and its
copy is then resumed as a 0005 save would be (docs/reliability.md).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

OPEN = "('reserved', 'running', 'requeued')"


def upgrade() -> None:
    p = table_prefix()
    work, old = f"{p}work", f"{p}checkpoints"
    with op.batch_alter_table(work) as batch:
        batch.add_column(sa.Column("checkpoint_takes", sa.BigInteger, nullable=True,
                                   server_default="0"))
    checkpointed_open = f"state IN {OPEN} AND checkpoint_json IS NOT NULL"
    op.execute(
        f"UPDATE {work} SET checkpoint_takes = NULL WHERE {checkpointed_open} AND EXISTS ("
        f"SELECT 1 FROM {old} c WHERE c.work_key = {work}.work_key AND "
        f"c.epoch >= {work}.checkpoint_epoch)")
    op.execute(
        f"UPDATE {work} SET checkpoint_takes = epoch - checkpoint_epoch WHERE "
        f"{checkpointed_open} AND checkpoint_takes IS NOT NULL AND checkpoint_epoch IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table(f"{table_prefix()}work") as batch:
        batch.drop_column("checkpoint_takes")
