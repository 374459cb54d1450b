"""The store's tables, defined once. Migrations create exactly this (a test diffs them).

Times are float seconds since the epoch taken from the database's clock, so leases never
depend on a worker's clock. JSON payloads are text written by :mod:`celery_resilient.core.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
)
from sqlalchemy.dialects import mysql

KEY = 255  # work keys, ledger keys, entry names: indexable on every dialect
# (utf8mb4 on InnoDB: 4 bytes a character, 255 x 4 = 1020 bytes a key column, and the widest
# key, steps' (work_key, name), 2040 bytes: within InnoDB's 3072-byte limit.)

#: Times: float seconds. SQLAlchemy's Float is a 4-byte FLOAT on MySQL (a second's
#: precision lost past 2^24): DOUBLE there, as PostgreSQL's FLOAT already is.
SECONDS = Float().with_variant(mysql.DOUBLE(asdecimal=False), "mysql", "mariadb")
#: JSON payloads and messages: MySQL's TEXT stops at 64 KiB; LONGTEXT there (4 GiB).
LONG_TEXT = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")



@dataclass(frozen=True)
class Tables:
    metadata: MetaData
    work: Table
    steps: Table
    ledger: Table
    schedule_runs: Table
    schedule_markers: Table
    contexts: Table
    workers: Table
    revocations: Table
    forgotten: Table
    #: Where checkpoints were kept before migration 0005 (see build_tables).
    old_checkpoints: Table


#: Percent of each work-table page PostgreSQL fills on insert: the rest keeps a checkpoint
#: save's new row version on its page, a HOT update that writes no index (migration 0010).
WORK_FILLFACTOR = 80


def build_tables(prefix: str = "resilient_") -> Tables:
    md = MetaData()
    p = prefix
    work = Table(
        f"{p}work", md,
        Column("work_key", String(KEY), primary_key=True),
        Column("task_name", String(KEY), nullable=False),
        Column("task_id", String(KEY), nullable=False),
        Column("args_digest", String(64), nullable=True),
        Column("state", String(16), nullable=False),
        Column("epoch", BigInteger, nullable=False, default=0),
        Column("owner_node", String(KEY), nullable=True),
        Column("incarnation", String(64), nullable=True),
        Column("owner_pid", Integer, nullable=True),
        Column("lease_expires_at", SECONDS, nullable=True),
        Column("attempts", Integer, nullable=False, default=0),
        Column("deaths", Integer, nullable=False, default=0),
        # Re-publishes since the work last made progress (reset by a checkpoint that changes
        # the saved state; a take is not progress): bounded by resilient_max_republish, and
        # the exponent of the backoff between them.
        Column("republished", Integer, nullable=False, default=0),
        # Celery's retry count of the try that holds or last held the claim: a stale copy of
        # an earlier try (re-published and also redelivered) never runs again.
        Column("retries", Integer, nullable=False, default=0, server_default="0"),
        Column("message_json", LONG_TEXT, nullable=True),
        Column("result_json", LONG_TEXT, nullable=True),
        Column("error", LONG_TEXT, nullable=True),
        Column("created_at", SECONDS, nullable=False),
        Column("updated_at", SECONDS, nullable=False),
        Column("finished_at", SECONDS, nullable=True),
        # The last checkpoint, in the work row itself: a save is one fenced UPDATE of one
        # row (a table of its own cost a second row write per save; migration 0005).
        # ``checkpoint_seq`` counts saves since the last clear (0: none).
        Column("checkpoint_json", LONG_TEXT, nullable=True),
        Column("checkpoint_seq", BigInteger, nullable=False, default=0, server_default="0"),
        Column("checkpoint_epoch", BigInteger, nullable=True),
        Column("checkpoint_at", SECONDS, nullable=True),
        # Takes by this version since the checkpoint was saved (migration 0006): a
        # checkpoint is resumed only if no take of another version came between (a worker
        # of the pre-0005 version may have cleared it in the table it keeps). NULL: still
        # 0005's copy of that table's row, which stays the one resumed.
        Column("checkpoint_takes", BigInteger, nullable=True, default=0, server_default="0"),
        # A claim handed back by ``self.replace()`` (migration 0008): only the message that
        # supersedes this epoch, the replacement, takes it; NULL: any message does.
        Column("handed_to", BigInteger, nullable=True),
        Index(f"ix_{p}work_state_lease", "state", "lease_expires_at"),
        Index(f"ix_{p}work_incarnation", "incarnation"),
        Index(f"ix_{p}work_task_id", "task_id"),  # revokes and operators find work by task id
        Index(f"ix_{p}work_finished_at", "finished_at"),  # retention (store/retention.py)
        postgresql_with={"fillfactor": WORK_FILLFACTOR},  # (migration 0010)
    )
    # Where checkpoints were kept before migration 0005 moved them into the work row. Kept
    # (and declared, so the migrations match this module) only for workers of the previous
    # version still running during a rolling deploy: they read and write it. This version
    # never writes a checkpoint there; it deletes a key's row wherever the previous version
    # would have (a clear, a hand-back that clears, forget, retention), so an old worker
    # never resumes work from a checkpoint that was cleared, and reads it only when a take of
    # the previous version came after the work row's checkpoint (``checkpoint_takes``,
    # migration 0006). A later migration drops it.
    old_checkpoints = Table(
        f"{p}checkpoints", md,
        Column("work_key", String(KEY), primary_key=True),
        Column("epoch", BigInteger, nullable=False),
        Column("seq", BigInteger, nullable=False),
        Column("state_json", LONG_TEXT, nullable=False),
        Column("updated_at", SECONDS, nullable=False),
    )
    steps = Table(
        f"{p}steps", md,
        Column("work_key", String(KEY), nullable=False),
        Column("name", String(KEY), nullable=False),
        Column("epoch", BigInteger, nullable=False),
        Column("result_json", LONG_TEXT, nullable=False),
        Column("created_at", SECONDS, nullable=False),
        PrimaryKeyConstraint("work_key", "name", name=f"pk_{p}steps"),
    )
    ledger = Table(
        f"{p}ledger", md,
        Column("key", String(KEY), primary_key=True),
        Column("work_key", String(KEY), nullable=True),
        Column("epoch", BigInteger, nullable=True),
        Column("result_json", LONG_TEXT, nullable=False),
        Column("applied_at", SECONDS, nullable=False),
        Index(f"ix_{p}ledger_applied_at", "applied_at"),  # retention
    )
    schedule_runs = Table(
        f"{p}schedule_runs", md,
        Column("entry", String(KEY), nullable=False),
        Column("slot", SECONDS, nullable=False),
        Column("state", String(16), nullable=False),
        Column("task_id", String(KEY), nullable=False),
        Column("owner", String(KEY), nullable=True),
        Column("claimed_at", SECONDS, nullable=False),
        Column("sent_at", SECONDS, nullable=True),
        PrimaryKeyConstraint("entry", "slot", name=f"pk_{p}schedule_runs"),
        Index(f"ix_{p}schedule_runs_state", "state"),
        Index(f"ix_{p}schedule_runs_claimed_at", "claimed_at"),  # retention
    )
    schedule_markers = Table(
        f"{p}schedule_markers", md,
        Column("entry", String(KEY), primary_key=True),
        Column("last_slot", SECONDS, nullable=False),
        Column("definition_json", LONG_TEXT, nullable=True),
        Column("updated_at", SECONDS, nullable=False),
    )
    contexts = Table(
        f"{p}contexts", md,
        Column("key", String(KEY), primary_key=True),
        Column("version", BigInteger, nullable=False),
        Column("data_json", LONG_TEXT, nullable=False),
        Column("updated_at", SECONDS, nullable=False),
        Index(f"ix_{p}contexts_updated_at", "updated_at"),  # retention pruning
    )
    workers = Table(
        f"{p}workers", md,
        Column("incarnation", String(64), primary_key=True),
        Column("node", String(KEY), nullable=False),
        Column("pid", Integer, nullable=False),
        Column("started_at", SECONDS, nullable=False),
        Column("heartbeat_at", SECONDS, nullable=False),
        Column("stopped_at", SECONDS, nullable=True),
        # The incarnation's lease: its claims are live while this is in the future. The
        # heartbeat renews this one row, whatever the number of claims.
        Column("lease_expires_at", SECONDS, nullable=True),
        # celery_resilient.core.liveness identity (host, boot, PID namespace, PID, start time):
        # a successor can prove this incarnation dead only from the same host and namespace.
        Column("process", String(KEY), nullable=True),
        # Set when a warm shutdown began: its claims are being handed off or drained.
        Column("draining_at", SECONDS, nullable=True),
        # PostgreSQL: the server start on which this incarnation took its liveness lock
        # (celery_resilient.store.liveness); NULL: no lock, judged by its lease alone.
        Column("liveness_server", SECONDS, nullable=True),
        # How it came to be stopped (migration 0007): stop, process, successor, session.
        Column("ended_by", String(16), nullable=True),
        # The broker it consumes from (celery_resilient.broker.identity, JSON; migration
        # 0009): a worker refuses to start beside a live one of this store on another broker.
        Column("broker", LONG_TEXT, nullable=True),
        Index(f"ix_{p}workers_node", "node"),
        Index(f"ix_{p}workers_heartbeat_at", "heartbeat_at"),  # retention
        Index(f"ix_{p}workers_stopped_at", "stopped_at"),  # retention
    )
    # Task ids revoked by Celery (``app.control.revoke``), copied from the workers' in-memory
    # revoke lists: a copy delivered after a restart, or to a worker that never heard the
    # broadcast, is still discarded. Kept for resilient_revoke_retention.
    revocations = Table(
        f"{p}revocations", md,
        Column("task_id", String(KEY), primary_key=True),
        Column("created_at", SECONDS, nullable=False),
        Index(f"ix_{p}revocations_created_at", "created_at"),
    )
    # The last epoch of work an operator forgot: the key's next row continues from it, so an
    # execution of the forgotten work (cancelled, still running) can never write into it.
    forgotten = Table(
        f"{p}forgotten", md,
        Column("work_key", String(KEY), primary_key=True),
        Column("epoch", BigInteger, nullable=False),
        Column("forgotten_at", SECONDS, nullable=False),
        Index(f"ix_{p}forgotten_forgotten_at", "forgotten_at"),
    )
    return Tables(md, work, steps, ledger, schedule_runs, schedule_markers,
                  contexts, workers, revocations, forgotten, old_checkpoints)
