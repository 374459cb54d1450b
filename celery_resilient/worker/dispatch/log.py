"""The dispatcher's one logger, ``celery_resilient.worker.dispatch``, for all of its parts.

Operators configure the batched takes' log lines (``action=...`` fields) by one name,
whichever part writes them.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "celery_resilient.worker.dispatch"

log = logging.getLogger(LOGGER_NAME)

__all__ = ["LOGGER_NAME", "log"]
