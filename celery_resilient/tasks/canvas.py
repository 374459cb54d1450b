"""What a resumable request's canvas needs: whether Celery does more after its body, stable
ids for its ``link`` callbacks, and the part of a replacement that carries its task id."""

from __future__ import annotations

import uuid
from typing import Any


def has_canvas(req: Any) -> bool:
    """Whether Celery does more than store the result after this request's body: links,
    errbacks, a chain, a chord or a group (their recovery needs ``done`` first)."""
    return bool(req.callbacks or req.errbacks or req.chain or req.chord or req.group)


def pin_link_ids(req: Any) -> None:
    """Each ``link`` callback of the request gets a task id derived from the request's.

    Celery sends a success's callbacks before it stores SUCCESS; a copy of the request that
    returns the stored result (its worker was killed in between, or it was delivered twice)
    makes Celery send them again. With the same id a resumable callback is the same work and
    runs once; without, it was a new task each time. A callback's own id is kept, and a
    canvas as a callback (a group, a chord) is sent as before: at least once.
    """
    for index, callback in enumerate(req.callbacks or ()):
        if isinstance(callback, dict) and not callback.get("subtask_type"):
            options = callback.setdefault("options", {})
            if not options.get("task_id"):
                options["task_id"] = str(uuid.uuid5(uuid.NAMESPACE_URL,
                                                    f"celery-resilient:{req.id}:link:{index}"))


def carrying_id(sig: Any, task_id: str) -> Any | None:
    """The task signature inside ``sig`` that Celery froze with ``task_id``: the signature
    itself, the last task of a chain, a chord's body (``celery.accumulate`` when a group was
    the replacement), at any depth."""
    body = getattr(sig, "body", None)
    tasks = getattr(sig, "tasks", None)
    if body is not None or tasks is not None:  # a canvas: look inside, the body first
        for part in ([body] if body is not None else []) + list(tasks or [])[::-1]:
            found = carrying_id(part, task_id)
            if found is not None:
                return found
        return None
    return sig if getattr(sig, "id", None) == task_id else None
