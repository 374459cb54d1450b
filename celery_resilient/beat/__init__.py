"""Scheduled work that survives beat restarts: ``ResilientScheduler`` (a RedBeat subclass).

``app.conf.beat_scheduler = "celery_resilient.beat:ResilientScheduler"``. Missed-slot maths
lives in :mod:`.windows`, catch-up policies in :mod:`.policy`, slot SQL in
:mod:`celery_resilient.store.schedule`, the worker's one-start-per-slot check for plain tasks
in :mod:`.once`.

The scheduler (:mod:`.scheduler`) keeps RedBeat's and Celery's surface and composes one part
per job: :mod:`.lock` (RedBeat's lock), :mod:`.firing` (claim, publish, record sent),
:mod:`.resend` (claimed-but-unsent slots), :mod:`.reconcile` (Redis against the store's
markers), :mod:`.maintenance` (the timed chores), sharing :mod:`.state`; :mod:`.entries`
(RedBeat's entry records), :mod:`.slot_ids` (a slot's task id and work key),
:mod:`.killpoints` (test-only) and :mod:`.log` (the one beat logger) serve them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_resilient.beat.policy import CatchupPolicy

if TYPE_CHECKING:
    from celery_resilient.beat.scheduler import ResilientScheduler


def __getattr__(name: str) -> Any:
    # Lazy: the scheduler needs RedBeat (the optional ``redis`` extra); workers import
    # ``celery_resilient.beat.once`` without it.
    if name == "ResilientScheduler":
        from celery_resilient.beat.scheduler import ResilientScheduler  # noqa: PLC0415

        return ResilientScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CatchupPolicy", "ResilientScheduler"]
