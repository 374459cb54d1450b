"""Compatibility with the pre-0005 checkpoint table, which workers of the previous version
still read and write during a rolling deploy. Everything that knows that table is here, to
be deleted with the migration that drops it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, delete


def checkpoint_to_resume(row: Any) -> tuple[str, int] | None:
    """The checkpoint to resume from, given the work row's checkpoint columns, its epoch,
    and the row a pre-0005 worker keeps (``old_state_json``, ``old_seq``).

    The work row's, unless a take of the pre-0005 version came after it was saved (each take
    since the save is counted in ``checkpoint_takes``; migration 0006 left it NULL where the
    old table's row may be newer); then the old table's row, or none if that version cleared
    it. Never later than the last one saved, so nothing is skipped."""
    if (row.checkpoint_json is not None and row.checkpoint_epoch is not None
            and row.checkpoint_takes is not None
            and row.epoch - row.checkpoint_epoch == row.checkpoint_takes):
        return str(row.checkpoint_json), int(row.checkpoint_seq)
    if row.old_state_json is not None:
        return str(row.old_state_json), int(row.old_seq)
    return None


class RowView:
    """Attribute access to a dict row (what :func:`checkpoint_to_resume` reads)."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.__dict__.update(row)


def delete_old_checkpoints(t: Any, conn: Connection, keys: Sequence[str]) -> None:
    """Delete these keys' rows of the pre-0005 checkpoint table (``t``: the store's tables),
    which workers of the previous version still read during a rolling deploy: a checkpoint
    cleared here must not be resumed from there (it skipped the work a retry or a fresh run
    must do)."""
    old = t.old_checkpoints
    conn.execute(delete(old).where(old.c.work_key.in_(list(keys))))
