"""Read-only admin views of the store: work (with its checkpoint), beat slots, contexts, workers.

Nothing here writes a row itself. The operator actions on work call
:mod:`celery_resilient.ops.operations`, which checks every row again under its lock and says
why it refuses one: re-publish dead or stuck work, cancel open work, retry ended work,
forget ended work. Each action needs its own permission (``republish_work``,
``cancel_work``, ``retry_work``, ``forget_work``); a user without it does not see it. Lease
times are shown against this web server's clock; the store judges leases by the database's
clock, so a skewed web server shows them a little off.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.contrib import admin, messages
from django.core.exceptions import ImproperlyConfigured
from django.db.models import QuerySet
from django.http import HttpRequest

from celery_resilient.contrib.django.conf import runtime
from celery_resilient.contrib.django.models import (
    Context,
    ScheduleMarker,
    ScheduleRun,
    Work,
    WorkerIncarnation,
    as_datetime,
)
from celery_resilient.ops import operations
from celery_resilient.ops.operations import ActionReport, RepublishRefused, Selection, republish

MAX_JSON_CHARS = 20_000
F = TypeVar("F", bound=Callable[..., Any])


def display(**kwargs: Any) -> Callable[[F], F]:
    """``admin.display`` with its type kept (Django ships no annotations)."""
    return cast(Callable[[F], F], admin.display(**kwargs))


def action(**kwargs: Any) -> Callable[[F], F]:
    """``admin.action`` with its type kept."""
    return cast(Callable[[F], F], admin.action(**kwargs))


def _pretty(value: str | None) -> str:
    if value is None:
        return "-"
    try:
        text = json.dumps(json.loads(value), indent=2, sort_keys=True, default=str)
    except ValueError:
        text = value
    return text if len(text) <= MAX_JSON_CHARS else text[:MAX_JSON_CHARS] + "\n... (truncated)"


def _lease(expires_at: float | None, now: float) -> str:
    if expires_at is None:
        return "-"
    left = expires_at - now
    return f"{left:.0f}s left" if left > 0 else f"expired {-left:.0f}s ago"


class ReadOnlyAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """Views only: no add, change or delete, whatever the user's permissions."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class LeaseFilter(admin.SimpleListFilter):  # type: ignore[misc]
    title = "lease"
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("live", "live"), ("expired", "expired (open work: stuck or orphaned)"),
                ("none", "none")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = time.time()
        if self.value() == "live":
            return queryset.filter(lease_expires_at__gt=now)
        if self.value() == "expired":
            return queryset.filter(lease_expires_at__lte=now,
                                   state__in=("reserved", "running", "requeued"))
        if self.value() == "none":
            return queryset.filter(lease_expires_at__isnull=True)
        return queryset


class RecentFilter(admin.SimpleListFilter):  # type: ignore[misc]
    """Filter on ``updated_at`` (or the field named by ``field``) by age."""

    title = "updated"
    parameter_name = "updated"
    field = "updated_at"
    AGES = {"1h": 3600.0, "24h": 86_400.0, "7d": 604_800.0}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("1h", "last hour"), ("24h", "last 24 hours"), ("7d", "last 7 days"),
                ("older", "more than 7 days ago")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        now = time.time()
        if value in self.AGES:
            return queryset.filter(**{f"{self.field}__gte": now - self.AGES[value]})
        if value == "older":
            return queryset.filter(**{f"{self.field}__lt": now - self.AGES["7d"]})
        return queryset


class HeartbeatFilter(RecentFilter):
    title = "last heartbeat"
    parameter_name = "heartbeat"
    field = "heartbeat_at"


@admin.register(Work)
class WorkAdmin(ReadOnlyAdmin):
    list_display = ("work_key", "task_name", "state", "owner_node", "lease", "attempts",
                    "deaths", "republished", "last_checkpoint", "updated")
    list_filter = ("state", LeaseFilter, "task_name", "owner_node")
    search_fields = ("work_key", "task_id", "task_name")
    actions = ["republish_selected", "cancel_selected", "retry_selected", "forget_selected"]
    fields = ("work_key", "task_name", "task_id", "state", "epoch", "owner_node",
              "incarnation", "owner_pid", "lease", "attempts", "deaths", "republished",
              "created", "updated", "finished", "error", "last_checkpoint",
              "checkpoint_state", "result", "message")
    readonly_fields = fields

    @display(description="lease", ordering="lease_expires_at")
    def lease(self, obj: Work) -> str:
        return _lease(obj.lease_expires_at, time.time())

    @display(description="last checkpoint")
    def last_checkpoint(self, obj: Work) -> str:
        if obj.checkpoint_json is None:
            return "-"
        at = as_datetime(obj.checkpoint_at)  # set with checkpoint_json by every save
        return f"#{obj.checkpoint_seq} at {at:%Y-%m-%d %H:%M:%S} (epoch {obj.checkpoint_epoch})"

    @display(description="checkpoint state")
    def checkpoint_state(self, obj: Work) -> str:
        return "-" if obj.checkpoint_json is None else _pretty(obj.checkpoint_json)

    @display(description="created", ordering="created_at")
    def created(self, obj: Work) -> Any:
        return as_datetime(obj.created_at)

    @display(description="updated", ordering="updated_at")
    def updated(self, obj: Work) -> Any:
        return as_datetime(obj.updated_at)

    @display(description="finished", ordering="finished_at")
    def finished(self, obj: Work) -> Any:
        return as_datetime(obj.finished_at)

    @display(description="result")
    def result(self, obj: Work) -> str:
        return _pretty(obj.result_json)

    @display(description="stored message")
    def message(self, obj: Work) -> str:
        return _pretty(obj.message_json)

    def _may(self, request: HttpRequest, codename: str) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.{codename}"))

    def has_republish_permission(self, request: HttpRequest) -> bool:
        return self._may(request, "republish_work")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self._may(request, "cancel_work")

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return self._may(request, "retry_work")

    def has_forget_permission(self, request: HttpRequest) -> bool:
        return self._may(request, "forget_work")

    @action(description="Re-publish selected dead or stuck work",
                  permissions=["republish"])
    def republish_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        try:
            rt = runtime()
        except ImproperlyConfigured as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        sent: list[str] = []
        for key in queryset.values_list("work_key", flat=True):
            try:
                republish(rt, key)
            except RepublishRefused as exc:
                self.message_user(request, str(exc), messages.WARNING)
            except Exception as exc:  # broker or store down: report it, don't error the page
                self.message_user(request, f"re-publish of {key!r} failed: {exc}",
                                  messages.ERROR)
            else:
                sent.append(key)
        if sent:
            self.message_user(request, f"re-published {len(sent)} unit(s) of work: "
                              + ", ".join(sent[:20]) + (" ..." if len(sent) > 20 else ""),
                              messages.SUCCESS)


    @action(description="Cancel selected open work (running work stops at its next write)",
            permissions=["cancel"])
    def cancel_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        who = request.user.get_username() or "an admin user"
        self._operate(request, queryset, "cancel", lambda rt, sel: operations.cancel(
            rt, sel, reason=f"by {who} in the Django admin"))

    @action(description="Retry selected ended work (send it again with its task id)",
            permissions=["retry"])
    def retry_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._operate(request, queryset, "retry", operations.retry)

    @action(description="Forget selected ended work (delete it; ledger markers stay)",
            permissions=["forget"])
    def forget_selected(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._operate(request, queryset, "forget", operations.forget)

    def _operate(self, request: HttpRequest, queryset: QuerySet[Any], verb: str,
                 act: Callable[[Any, Selection], ActionReport]) -> None:
        """Run one operator action on the selected keys and report it, refusals included."""
        try:
            rt = runtime()
        except ImproperlyConfigured as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        keys = tuple(str(k) for k in queryset.values_list("work_key", flat=True))
        try:
            report = act(rt, Selection(keys=keys))
        except Exception as exc:  # store down: report it, don't error the page
            self.message_user(request, f"{verb} failed: {exc}", messages.ERROR)
            return
        for r in report.refused:
            self.message_user(request, f"cannot {verb} {r.work_key!r}: {r.reason}",
                              messages.WARNING)
        for key, error in report.unsent:
            self.message_user(request, f"{key!r} was re-queued but its message was not sent "
                              f"({error}); a worker's sweep sends it after "
                              "resilient_submit_timeout", messages.ERROR)
        if report.changed:
            done = [t.work_key for t in report.changed]
            extra = (f" with {report.checkpoints} checkpoint(s) and {report.steps} step(s); "
                     "their ledger markers are kept" if verb == "forget" else "")
            self.message_user(request, f"{_PAST[verb]} {len(done)} unit(s) of work{extra}: "
                              + ", ".join(done[:20]) + (" ..." if len(done) > 20 else ""),
                              messages.SUCCESS)


_PAST = {"cancel": "cancelled", "retry": "retried", "forget": "forgot"}


@admin.register(ScheduleRun)
class ScheduleRunAdmin(ReadOnlyAdmin):
    list_display = ("entry", "slot_time", "state", "task_id", "owner", "claimed", "sent")
    list_filter = ("state", "entry")
    search_fields = ("entry", "task_id")
    fields = ("entry", "slot_time", "state", "task_id", "owner", "claimed", "sent")
    readonly_fields = fields

    @display(description="slot", ordering="slot")
    def slot_time(self, obj: ScheduleRun) -> Any:
        return as_datetime(obj.slot)

    @display(description="claimed", ordering="claimed_at")
    def claimed(self, obj: ScheduleRun) -> Any:
        return as_datetime(obj.claimed_at)

    @display(description="sent", ordering="sent_at")
    def sent(self, obj: ScheduleRun) -> Any:
        return as_datetime(obj.sent_at)


@admin.register(ScheduleMarker)
class ScheduleMarkerAdmin(ReadOnlyAdmin):
    list_display = ("entry", "last_slot_time", "updated")
    search_fields = ("entry",)
    fields = ("entry", "last_slot_time", "updated", "definition")
    readonly_fields = fields

    @display(description="last slot", ordering="last_slot")
    def last_slot_time(self, obj: ScheduleMarker) -> Any:
        return as_datetime(obj.last_slot)

    @display(description="updated", ordering="updated_at")
    def updated(self, obj: ScheduleMarker) -> Any:
        return as_datetime(obj.updated_at)

    @display(description="definition")
    def definition(self, obj: ScheduleMarker) -> str:
        return _pretty(obj.definition_json)


@admin.register(Context)
class ContextAdmin(ReadOnlyAdmin):
    list_display = ("key", "version", "size", "updated")
    list_filter = (RecentFilter,)
    search_fields = ("key",)
    fields = ("key", "version", "updated", "data")
    readonly_fields = fields

    @display(description="bytes")
    def size(self, obj: Context) -> int:
        return len(obj.data_json.encode())

    @display(description="updated", ordering="updated_at")
    def updated(self, obj: Context) -> Any:
        return as_datetime(obj.updated_at)

    @display(description="data")
    def data(self, obj: Context) -> str:
        return _pretty(obj.data_json)


@admin.register(WorkerIncarnation)
class WorkerIncarnationAdmin(ReadOnlyAdmin):
    list_display = ("node", "incarnation", "pid", "started", "heartbeat", "stopped")
    list_filter = (HeartbeatFilter, ("stopped_at", admin.EmptyFieldListFilter), "node")
    search_fields = ("node", "incarnation")

    @display(description="started", ordering="started_at")
    def started(self, obj: WorkerIncarnation) -> Any:
        return as_datetime(obj.started_at)

    @display(description="last heartbeat", ordering="heartbeat_at")
    def heartbeat(self, obj: WorkerIncarnation) -> Any:
        return as_datetime(obj.heartbeat_at)

    @display(description="stopped", ordering="stopped_at")
    def stopped(self, obj: WorkerIncarnation) -> Any:
        return as_datetime(obj.stopped_at)


__all__ = ["ContextAdmin", "ScheduleMarkerAdmin", "ScheduleRunAdmin", "WorkAdmin",
           "WorkerIncarnationAdmin"]
