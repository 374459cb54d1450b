"""The last checkpoint moves into the work row: a save writes one row, not two.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

``<prefix>checkpoints`` held one row per unit of work (its last checkpoint); every save
fenced the work row and upserted that one, two row writes per save. The upgrade copies each
checkpoint into its work row (``checkpoint_json``, ``checkpoint_seq``, ``checkpoint_epoch``,
``checkpoint_at``). The old table stays for the length of a rolling deploy: a worker of the
previous version still running reads and writes its checkpoints there instead of failing its
tasks. The new version never writes a checkpoint there, and deletes a key's row wherever
the previous version would have (clear, a retry's hand-back, forget, retention), so an old
worker never resumes from a checkpoint the new version cleared. The reverse (an old worker's
clear, seen only in its table) is covered by migration 0006. Between the two versions a
checkpoint can only be older than the last one saved: work handed from one version to the
other resumes from the migration's copy, the other table's last save, or zero, and is done
again from there. A later migration drops
the table. The downgrade writes the work rows' checkpoints
back into it. Both rewrite every row that has a checkpoint in one
transaction: on a large PostgreSQL store, run ``celery -A proj resilient migrate`` at a
quiet moment.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix
from celery_resilient.store.schema import LONG_TEXT, SECONDS

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: (work column, checkpoints column) copied between the two shapes.
COPIED = (("checkpoint_json", "state_json"), ("checkpoint_seq", "seq"),
          ("checkpoint_epoch", "epoch"), ("checkpoint_at", "updated_at"))


def upgrade() -> None:
    p = table_prefix()
    with op.batch_alter_table(f"{p}work") as batch:
        batch.add_column(sa.Column("checkpoint_json", LONG_TEXT, nullable=True))
        batch.add_column(sa.Column("checkpoint_seq", sa.BigInteger, nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("checkpoint_epoch", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("checkpoint_at", SECONDS, nullable=True))
    work, cps = f"{p}work", f"{p}checkpoints"
    sets = ", ".join(f"{ours} = (SELECT c.{theirs} FROM {cps} c WHERE c.work_key = "
                     f"{work}.work_key)" for ours, theirs in COPIED)
    op.execute(f"UPDATE {work} SET {sets} WHERE work_key IN (SELECT work_key FROM {cps})")


def downgrade() -> None:
    p = table_prefix()
    op.execute(f"DELETE FROM {p}checkpoints")
    op.execute(
        f"INSERT INTO {p}checkpoints (work_key, epoch, seq, state_json, updated_at) "
        f"SELECT work_key, COALESCE(checkpoint_epoch, epoch), checkpoint_seq, checkpoint_json, "
        f"COALESCE(checkpoint_at, updated_at) FROM {p}work WHERE checkpoint_json IS NOT NULL")
    with op.batch_alter_table(f"{p}work") as batch:
        batch.drop_column("checkpoint_at")
        batch.drop_column("checkpoint_epoch")
        batch.drop_column("checkpoint_seq")
        batch.drop_column("checkpoint_json")
