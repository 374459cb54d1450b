"""Scheduled work that survives beat restarts: ``ResilientScheduler`` (a RedBeat subclass).

``app.conf.beat_scheduler = "celery_resilient.beat:ResilientScheduler"``. Missed-slot maths
lives in :mod:`.windows`, catch-up policies in :mod:`.policy`, slot SQL in
:mod:`celery_resilient.store.schedule`.
"""

from celery_resilient.beat.policy import CatchupPolicy
from celery_resilient.beat.scheduler import ResilientScheduler

__all__ = ["CatchupPolicy", "ResilientScheduler"]
