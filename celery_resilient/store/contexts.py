"""Every query on the contexts table: the durable side of the continuity context.

A context row is (key, version, data_json, updated_at). Every write is one compare-and-set
statement on ``version`` (``UPDATE ... WHERE key = ? AND version = ?``), so a stale writer
matches no row and changes nothing; the row is replaced whole inside one transaction, so a
crash leaves the old or the new version, never a mix. Writes made on behalf of a task may
be fenced by its claim (``fence=(work_key, epoch)``) in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, case, delete, select, update

from celery_resilient.errors import ContextConflict, ContextNotFound
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded
from celery_resilient.store.retention import delete_contexts

Fence = tuple[str, int]


@dataclass(frozen=True)
class StoredContext:
    """A row as read. ``data_json`` is None when the caller already holds this version."""

    key: str
    version: int
    data_json: str | None
    updated_at: float


class ContextRows:
    """Reads and compare-and-set writes of context rows, on a store's plumbing (:mod:`.db`)."""

    def __init__(self, store: Database) -> None:
        self.store = store
        self.table = store.t.contexts

    @guarded
    def read(self, key: str, known_version: int | None = None) -> StoredContext | None:
        """The row of ``key``; its data is left out when it is still ``known_version``.

        One round trip either way, so a process-local cache can confirm its copy cheaply.
        """
        c = self.table
        data = (c.c.data_json if known_version is None
                else case((c.c.version == known_version, None), else_=c.c.data_json))
        with self.store.reading() as conn:
            row = conn.execute(
                select(c.c.version, data.label("data_json"), c.c.updated_at)
                .where(c.c.key == key)
            ).first()
        if row is None:
            return None
        return StoredContext(key, int(row.version), row.data_json, float(row.updated_at))

    @guarded
    def create(self, key: str, data_json: str, fence: Fence | None = None) -> int:
        """Insert version 1; :class:`ContextConflict` if ``key`` already exists."""
        c = self.table
        stmt = (self.store.dialect.insert(c)
                .values(key=key, version=1, data_json=data_json,
                        updated_at=self.store.dialect.now())
                .on_conflict_do_nothing(index_elements=[c.c.key]))
        with self.store.begin() as conn:
            self._fence(conn, fence)
            if not self.store.dialect.insert_if_absent(conn, stmt):
                current = self._version(conn, key)
                raise ContextConflict(
                    f"context {key!r} already exists (version {current}); read it with get() "
                    "or write it with put(..., expected_version=...)"
                )
        return 1

    @guarded
    def update(self, key: str, data_json: str, expected_version: int | None,
               fence: Fence | None = None) -> int:
        """Replace the data and bump the version, only if it still is ``expected_version``.

        ``expected_version=None`` overwrites whatever version is stored (last writer wins).
        Returns the new version.
        """
        c = self.table
        cond = [c.c.key == key]
        if expected_version is not None:
            cond.append(c.c.version == expected_version)
        stmt = (update(c).where(*cond)
                .values(version=c.c.version + 1, data_json=data_json,
                        updated_at=self.store.dialect.now()))
        with self.store.begin() as conn:
            self._fence(conn, fence)
            row = self.store.dialect.update_returning(conn, stmt, c.c.key == key, c.c.version)
            if row is None:
                raise self._refusal(conn, key, expected_version, "updated")
        return int(row.version)

    @guarded
    def delete(self, key: str, expected_version: int | None = None,
               fence: Fence | None = None) -> bool:
        """Delete ``key`` (only at ``expected_version`` if given); False if it was absent."""
        c = self.table
        cond = [c.c.key == key]
        if expected_version is not None:
            cond.append(c.c.version == expected_version)
        with self.store.begin() as conn:
            self._fence(conn, fence)
            if conn.execute(delete(c).where(*cond)).rowcount == 1:
                return True
            if expected_version is None:
                return False
            raise self._refusal(conn, key, expected_version, "deleted")

    def prune(self, older_than: float, limit: int = 1000) -> list[str]:
        """Delete up to ``limit`` contexts not written for ``older_than`` seconds; their keys.

        Batched so a large backlog never holds one long transaction; call until it returns
        fewer than ``limit`` keys. The delete is :func:`.retention.delete_contexts`, the one
        the worker's automatic retention runs.
        """
        return delete_contexts(self.store, self.store.now() - older_than, limit)

    # -- helpers ----------------------------------------------------------------------------

    def _fence(self, conn: Connection, fence: Fence | None) -> None:
        if fence is not None:
            self.store.fence(conn, *fence)

    def _version(self, conn: Connection, key: str) -> int | None:
        c = self.table
        value = conn.execute(select(c.c.version).where(c.c.key == key)).scalar_one_or_none()
        return None if value is None else int(value)

    def _refusal(self, conn: Connection, key: str, expected: int | None,
                 verb: str) -> ContextNotFound | ContextConflict:
        current = self._version(conn, key)
        if current is None:
            return ContextNotFound(
                f"no context is stored under {key!r}; nothing {verb}. Create it explicitly "
                "with create(key, data)"
            )
        return ContextConflict(
            f"context {key!r} is at version {current}, not {expected}: someone else changed "
            "it since it was read; nothing was overwritten. Read it again and reapply"
        )
