"""The task id and work key of a slot, derived from (entry, slot) alone. Pure.

Every beat, every re-send and every restart derives the same two names for a slot, so the
copies of a slot's message are recognisably one run: a ``ResumableTask`` runs a work key once,
and a plain task's start is checked by its slot (:mod:`.once`).
"""

from __future__ import annotations

import hashlib
import uuid

from celery_resilient.beat.windows import from_us
from celery_resilient.core import workkey

TASK_ID_NAMESPACE = uuid.UUID("6f1c2a4e-6a36-4d0b-9a51-5b8a4c3a7e10")


def task_id_for(entry_key: str, slot: int) -> str:
    """The task id of a slot: the same on every beat, every re-send, every restart."""
    return str(uuid.uuid5(TASK_ID_NAMESPACE, f"{entry_key}\n{slot}"))


def work_key_for(entry_key: str, slot: int) -> str:
    """The work key of a slot, so a slot delivered twice runs once (``ResumableTask``)."""
    stamp = from_us(slot).isoformat()
    key = f"beat:{entry_key}@{stamp}"
    if len(key) > workkey.MAX_LENGTH:
        key = f"beat:{hashlib.sha256(entry_key.encode()).hexdigest()[:40]}@{stamp}"
    return key


__all__ = ["TASK_ID_NAMESPACE", "task_id_for", "work_key_for"]
