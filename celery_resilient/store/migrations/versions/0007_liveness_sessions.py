"""Proof of death by session: the server start an incarnation's lock was taken on, and how
it ended.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

A worker incarnation on PostgreSQL holds a session-level advisory lock for as long as it
lives (``celery_resilient.store.liveness``). Another session that can take the lock has proof
that the holder's session is gone, but only if the holder had taken it on the server that runs
now: a restart or a failover frees every lock at once. ``liveness_server`` records that
server's start time (``pg_postmaster_start_time()``, seconds since the epoch); NULL means the
incarnation holds no such lock (SQLite, a pooler in transaction mode, or the proof turned off)
and is judged by its lease alone.

``ended_by`` says how an incarnation came to be stopped: ``stop`` (it stopped itself),
``process`` (a successor on its host saw its process gone), ``successor`` (a later start of
its node name found its session ended). NULL: stopped before this revision. Another worker's
sweep that finds a session ended does not stop the incarnation (it may run on behind a
partition): it ends its lease.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from celery_resilient.store.migrate import table_prefix
from celery_resilient.store.schema import SECONDS

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = table_prefix()
    with op.batch_alter_table(f"{p}workers") as batch:
        batch.add_column(sa.Column("liveness_server", SECONDS, nullable=True))
        batch.add_column(sa.Column("ended_by", sa.String(16), nullable=True))


def downgrade() -> None:
    p = table_prefix()
    with op.batch_alter_table(f"{p}workers") as batch:
        batch.drop_column("ended_by")
        batch.drop_column("liveness_server")
