"""Where ``RESILIENT_CELERY_APP`` points: the conftest puts a fresh Celery app here per test."""

from __future__ import annotations

from celery import Celery

app: Celery | None = None
