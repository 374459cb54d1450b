"""Read-only, unmanaged Django models over the store's own tables.

The store owns its schema (``manage.py resilient_migrate`` runs its Alembic migrations);
Django never creates, alters or migrates these tables (``managed = False``), and the admin
never writes them itself: the changes an operator can make (re-publish, cancel, retry,
forget) go through :mod:`celery_resilient.operations`, each behind its own permission.
The table names follow ``CELERY_RESILIENT_TABLE_PREFIX`` (``resilient_`` by default), read
when this module is imported. They are queried through Django's ``default`` database, so
the admin shows the store only when the store lives in that database.

Times are stored as float seconds since the epoch (by the database's clock); the ``*_dt``
properties give aware datetimes for display.
"""

from __future__ import annotations

from datetime import datetime, timezone

from django.db import models

from ...states import ALL_STATES
from .conf import table_prefix

PREFIX = table_prefix()
STATES = [(s, s) for s in ALL_STATES]
SLOT_STATES = [(s, s) for s in ("claimed", "sent", "started", "skipped")]


def as_datetime(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=timezone.utc)


class Work(models.Model):  # type: ignore[misc]
    """One unit of work (``<prefix>work``): its claim, lease, counters and stored message."""

    work_key = models.CharField(max_length=255, primary_key=True)
    task_name = models.CharField(max_length=255)
    task_id = models.CharField(max_length=255)
    args_digest = models.CharField(max_length=64, null=True)
    state = models.CharField(max_length=16, choices=STATES)
    epoch = models.BigIntegerField()
    owner_node = models.CharField(max_length=255, null=True)
    incarnation = models.CharField(max_length=64, null=True)
    owner_pid = models.IntegerField(null=True)
    lease_expires_at = models.FloatField(null=True)
    attempts = models.IntegerField()
    deaths = models.IntegerField()
    republished = models.IntegerField()
    message_json = models.TextField(null=True)
    result_json = models.TextField(null=True)
    error = models.TextField(null=True)
    created_at = models.FloatField()
    updated_at = models.FloatField()
    finished_at = models.FloatField(null=True)

    class Meta:
        managed = False
        db_table = f"{PREFIX}work"
        verbose_name = "work"
        verbose_name_plural = "work"
        ordering = ["-updated_at"]
        default_permissions = ("view",)
        permissions = [("republish_work", "Can re-publish dead or stuck work"),
                       ("cancel_work", "Can cancel open work"),
                       ("retry_work", "Can retry ended work"),
                       ("forget_work", "Can forget (delete) ended work")]

    def __str__(self) -> str:
        return str(self.work_key)


class Checkpoint(models.Model):  # type: ignore[misc]
    """The last checkpoint of a unit of work (``<prefix>checkpoints``)."""

    work = models.OneToOneField(Work, primary_key=True, db_column="work_key",
                                db_constraint=False, on_delete=models.DO_NOTHING,
                                related_name="checkpoint")
    epoch = models.BigIntegerField()
    seq = models.BigIntegerField()
    state_json = models.TextField()
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = f"{PREFIX}checkpoints"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"checkpoint {self.seq} of {self.pk}"


class ScheduleRun(models.Model):  # type: ignore[misc]
    """One beat slot (``<prefix>schedule_runs``).

    The table's key is (entry, slot); its task id is derived from both (uuid5), so it is
    unique too and serves as Django's primary key.
    """

    task_id = models.CharField(max_length=255, primary_key=True)
    entry = models.CharField(max_length=255)
    slot = models.FloatField()
    state = models.CharField(max_length=16, choices=SLOT_STATES)
    owner = models.CharField(max_length=255, null=True)
    claimed_at = models.FloatField()
    sent_at = models.FloatField(null=True)

    class Meta:
        managed = False
        db_table = f"{PREFIX}schedule_runs"
        verbose_name = "schedule slot"
        ordering = ["-slot"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.entry} @ {as_datetime(self.slot)}"


class ScheduleMarker(models.Model):  # type: ignore[misc]
    """The last slot a beat entry has reached (``<prefix>schedule_markers``)."""

    entry = models.CharField(max_length=255, primary_key=True)
    last_slot = models.FloatField()
    definition_json = models.TextField(null=True)
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = f"{PREFIX}schedule_markers"
        verbose_name = "schedule marker"
        ordering = ["entry"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return str(self.entry)


class Context(models.Model):  # type: ignore[misc]
    """A continuity context (``<prefix>contexts``)."""

    key = models.CharField(max_length=255, primary_key=True)
    version = models.BigIntegerField()
    data_json = models.TextField()
    updated_at = models.FloatField()

    class Meta:
        managed = False
        db_table = f"{PREFIX}contexts"
        verbose_name = "context"
        ordering = ["-updated_at"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return str(self.key)


class WorkerIncarnation(models.Model):  # type: ignore[misc]
    """One start of a worker node and its last heartbeat (``<prefix>workers``)."""

    incarnation = models.CharField(max_length=64, primary_key=True)
    node = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = models.FloatField()
    heartbeat_at = models.FloatField()
    stopped_at = models.FloatField(null=True)

    class Meta:
        managed = False
        db_table = f"{PREFIX}workers"
        verbose_name = "worker incarnation"
        ordering = ["-heartbeat_at"]
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.node} ({self.incarnation})"
