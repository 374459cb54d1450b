"""Read-only, unmanaged Django models over the store's own tables.

The store owns its schema (``manage.py resilient_migrate`` runs its Alembic migrations);
Django never creates, alters or migrates these tables (``managed = False``), and the admin
never writes them itself: the changes an operator can make (re-publish, cancel, retry,
forget) go through :mod:`celery_resilient.ops.operations`, each behind its own permission.
The table names follow ``CELERY_RESILIENT_TABLE_PREFIX`` (``resilient_`` by default), read
when this module is imported. They are queried through Django's ``default`` database, so
the admin shows the store only when the store lives in that database.

Every field comes from the table definitions in :mod:`celery_resilient.store.schema`
(:func:`columns`), so a migration that adds a column reaches the admin without a second
copy of the schema; a model only names what Django needs beyond the table (choices, one
primary key where the table has a composite one).

Times are stored as float seconds since the epoch (by the database's clock);
:func:`as_datetime` gives aware datetimes for display.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from django.db import models
from sqlalchemy import BigInteger, Float, Integer, String, Table, Text

from celery_resilient.contrib.django.conf import table_prefix
from celery_resilient.core.states import ALL_STATES
from celery_resilient.store.schema import build_tables

PREFIX = table_prefix()
TABLES = build_tables(PREFIX)
STATES = [(s, s) for s in ALL_STATES]
SLOT_STATES = [(s, s) for s in ("claimed", "sent", "started", "skipped")]


def as_datetime(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


def _field(column: Any, primary_key: bool) -> models.Field:
    kind, opts = column.type, {"null": bool(column.nullable) and not primary_key,
                               "primary_key": primary_key}
    if isinstance(kind, String) and not isinstance(kind, Text):
        return models.CharField(max_length=kind.length, **opts)
    if isinstance(kind, Text):
        return models.TextField(**opts)
    if isinstance(kind, BigInteger):
        return models.BigIntegerField(**opts)
    if isinstance(kind, Integer):
        return models.IntegerField(**opts)
    if isinstance(kind, Float):
        return models.FloatField(**opts)
    raise TypeError(f"column {column.table.name}.{column.name}: no Django field for {kind!r}")


def columns(table: Table, pk: str | None = None, **overrides: models.Field) -> dict[str, Any]:
    """Django fields for every column of ``table``; ``pk`` names the primary key where the
    table's is composite; ``overrides`` replace the derived field of a column."""
    keys = [c.name for c in table.primary_key.columns]
    pk = pk or (keys[0] if len(keys) == 1 else None)
    if pk is None:
        raise TypeError(f"table {table.name} has a composite key: name the field Django uses")
    fields: dict[str, Any] = {}
    for column in table.columns:
        if column.name in overrides:
            continue
        fields[column.name] = _field(column, column.name == pk)
    fields.update(overrides)
    return fields


def _model(name: str, table: Table, meta: dict[str, Any], fields: dict[str, Any],
           **methods: Any) -> Any:
    meta = {"managed": False, "db_table": table.name, "default_permissions": ("view",), **meta}
    attrs = {"__module__": __name__, "__qualname__": name, "Meta": type("Meta", (), meta),
             **fields, **methods}
    return type(models.Model)(name, (models.Model,), attrs)


Work = _model(
    "Work", TABLES.work,
    {"verbose_name": "work", "verbose_name_plural": "work", "ordering": ["-updated_at"],
     "permissions": [("republish_work", "Can re-publish dead or stuck work"),
                     ("cancel_work", "Can cancel open work"),
                     ("retry_work", "Can retry ended work"),
                     ("forget_work", "Can forget (delete) ended work")]},
    columns(TABLES.work, state=models.CharField(max_length=16, choices=STATES)),
    __doc__="One unit of work (``<prefix>work``): its claim, lease, counters and message.",
    __str__=lambda self: str(self.work_key),
)

# The table's key is (entry, slot); its task id is derived from both (uuid5), so it is
# unique too and serves as Django's primary key.
ScheduleRun = _model(
    "ScheduleRun", TABLES.schedule_runs,
    {"verbose_name": "schedule slot", "ordering": ["-slot"]},
    columns(TABLES.schedule_runs, pk="task_id",
            state=models.CharField(max_length=16, choices=SLOT_STATES)),
    __doc__="One beat slot (``<prefix>schedule_runs``).",
    __str__=lambda self: f"{self.entry} @ {as_datetime(self.slot)}",
)

ScheduleMarker = _model(
    "ScheduleMarker", TABLES.schedule_markers,
    {"verbose_name": "schedule marker", "ordering": ["entry"]},
    columns(TABLES.schedule_markers),
    __doc__="The last slot a beat entry has reached (``<prefix>schedule_markers``).",
    __str__=lambda self: str(self.entry),
)

Context = _model(
    "Context", TABLES.contexts,
    {"verbose_name": "context", "ordering": ["-updated_at"]},
    columns(TABLES.contexts),
    __doc__="A continuity context (``<prefix>contexts``).",
    __str__=lambda self: str(self.key),
)

WorkerIncarnation = _model(
    "WorkerIncarnation", TABLES.workers,
    {"verbose_name": "worker incarnation", "ordering": ["-heartbeat_at"]},
    columns(TABLES.workers),
    __doc__="One start of a worker node and its lease (``<prefix>workers``).",
    __str__=lambda self: f"{self.node} ({self.incarnation})",
)
