"""The beat's one logger, ``celery_resilient.beat.scheduler``, for every part of the beat.

The scheduler was one module once; operators configure its log lines by that logger's name
(``action=...`` fields, the per-slot DEBUG lines of a catch-up). The parts it was split into
(lock, firing, re-sends, reconcile, maintenance) log through the same logger, so that name
keeps covering all of them.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "celery_resilient.beat.scheduler"

log = logging.getLogger(LOGGER_NAME)

__all__ = ["LOGGER_NAME", "log"]
