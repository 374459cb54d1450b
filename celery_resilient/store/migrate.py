"""Schema migrations through Alembic, and the startup check that the schema is current."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command, op
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from celery_resilient.errors import SchemaError
from celery_resilient.store.engine import for_writing

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).with_name("migrations")
#: Alembic logs "Context impl ..." and "Will assume transactional DDL." at INFO on every schema
#: check, so in the main process and in every pool process. That logger is held at WARNING
#: unless the application gave it a level of its own; no other logger (root included) is
#: touched. ``logging.getLogger(ALEMBIC_LOGGER).setLevel(logging.INFO)`` shows them again.
ALEMBIC_LOGGER = "alembic.runtime.migration"
FIX_COMMAND = "celery -A <your app> resilient migrate"
_current_prefix: list[str] = []


def table_prefix() -> str:
    """The prefix of the migration being run; read by revision scripts."""
    return _current_prefix[-1]


def table_options() -> dict[str, str]:
    """Table options of a revision script's ``create_table``, for the server it runs on.

    MySQL/MariaDB: InnoDB, ``utf8mb4``, and a binary collation without pad space, so keys
    compare as PostgreSQL and SQLite compare them: ``"Key"`` is not ``"key"`` and ``"k "``
    is not ``"k"`` (the servers' defaults are case-insensitive, and their ``utf8mb4_bin``
    pads with spaces). The collation's name differs between the two servers."""
    dialect = op.get_bind().dialect
    if dialect.name not in ("mysql", "mariadb"):
        return {}
    collation = "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"
    return {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4",
            "mysql_collate": collation}


def _quiet_alembic() -> None:
    logger = logging.getLogger(ALEMBIC_LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def _config(prefix: str, connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["table_prefix"] = prefix
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config("x")).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine, prefix: str) -> str | None:
    _quiet_alembic()
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": f"{prefix}alembic_version"})
        rev: str | None = ctx.get_current_revision()
        conn.rollback()
        return rev


def _serialize(conn: Connection, prefix: str) -> None:
    """One migration of a prefix at a time: workers started together with
    ``resilient_auto_migrate`` would otherwise race to create the same tables (the loser
    exited with a duplicate key on the version table). On PostgreSQL a transaction-level
    advisory lock keyed by the prefix, taken before Alembic reads the current revision, so
    the next one in line finds the schema at head; SQLite's writing transaction
    (``for_writing``) already admits one writer. MySQL's DDL commits as it goes, so there
    the lock is a session-level named lock (``GET_LOCK``), held until :func:`_unserialize`
    or the session's end."""
    if conn.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.blake2b(f"celery-resilient:{prefix}".encode(),
                                             digest_size=8).digest(), "big", signed=True)
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
    elif conn.dialect.name in ("mysql", "mariadb"):
        got = conn.execute(text("SELECT GET_LOCK(:name, :wait)"),
                           {"name": _lock_name(prefix), "wait": MYSQL_MIGRATION_WAIT}
                           ).scalar_one()
        if got != 1:
            raise SchemaError(f"another process held the migration lock of tables {prefix}* "
                              f"for {MYSQL_MIGRATION_WAIT} s; run `{FIX_COMMAND}` again")


#: Seconds a MySQL migration waits for another one of the same prefix.
MYSQL_MIGRATION_WAIT = 300


def _lock_name(prefix: str) -> str:
    """A MySQL lock name (at most 64 characters) for the migrations of ``prefix``."""
    return "celery-resilient:migrate:" + hashlib.blake2b(prefix.encode(),
                                                         digest_size=16).hexdigest()


def _unserialize(conn: Connection, prefix: str) -> None:
    if conn.dialect.name in ("mysql", "mariadb"):
        conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": _lock_name(prefix)})


def upgrade(engine: Engine, prefix: str, revision: str = "head") -> None:
    _run(command.upgrade, engine, prefix, revision)


def downgrade(engine: Engine, prefix: str, revision: str) -> None:
    _run(command.downgrade, engine, prefix, revision)


def _run(alembic_command: Callable[[Config, str], None], engine: Engine, prefix: str,
         revision: str) -> None:
    """Run an Alembic command on ``prefix``'s tables, one migration of a prefix at a time."""
    _quiet_alembic()
    with engine.connect() as conn:
        try:
            with for_writing(conn).begin():
                _serialize(conn, prefix)
                _current_prefix.append(prefix)
                try:
                    alembic_command(_config(prefix, conn), revision)
                finally:
                    _current_prefix.pop()
        finally:
            # once committed: the next in line must read the revision this one recorded
            _unserialize(conn, prefix)


def check(engine: Engine, prefix: str, migrate_if_needed: bool) -> None:
    """Fail clearly on a missing or outdated schema, or bring it up to date when allowed."""
    current = current_revision(engine, prefix)
    head = head_revision()
    if current == head:
        return
    if migrate_if_needed:
        upgrade(engine, prefix)
        log.info("celery-resilient schema (tables %s*) migrated from %s to %s", prefix,
                 current or "nothing", head, extra={"action": "schema_migrated"})
        return
    state = "missing" if current is None else f"at revision {current}, expected {head}"
    raise SchemaError(
        f"The celery-resilient schema (tables {prefix}*) is {state}. "
        f"Run `{FIX_COMMAND}` (or set resilient_auto_migrate=True)."
    )


def describe(engine: Engine, prefix: str) -> dict[str, Any]:
    return {"current": current_revision(engine, prefix), "head": head_revision()}
