"""What a resumable request asks of, and tells, Celery's result backend.

The store decides whether work runs; the result backend is what the caller reads. These
queries keep the two telling one story: a copy of ended work reports what the caller was not
told, and a resumed execution that the caller was already told about runs nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend

from celery_resilient.core import codec
from celery_resilient.errors import ResilientError

log = logging.getLogger(__name__)


def stores_results(task: Any) -> bool:
    """Whether this request's result reaches a result backend a caller can read."""
    return not (task.ignore_result or task.request.ignore_result
                or isinstance(task.backend, DisabledBackend))


def already_reported(task: Any, state: str) -> bool:
    """Whether the result backend already holds ``state`` (SUCCESS, FAILURE) for this
    request.

    Without a result backend nothing can tell; the copy then tells Celery again (the stored
    result, or the stored failure), and Celery sends the request's callbacks or errbacks
    again: docs/reliability.md.
    """
    req = task.request
    if req.is_eager or not stores_results(task):
        return False
    try:
        return bool(task.backend.get_state(req.id) == state)
    except Exception as exc:  # backend down: returning the stored result is the safe side
        log.warning("result backend unreadable for %s: %s", req.id, exc)
        return False


def told(task: Any) -> tuple[str, Any] | None:
    """How the caller was told this request ended (SUCCESS, FAILURE or REVOKED, with the
    result), or None: not told, no result backend, or the backend unreadable."""
    req = task.request
    if req.is_eager or not stores_results(task):
        return None
    try:
        meta = task.backend.get_task_meta(req.id)
    except Exception as exc:  # backend down: run, as before this check
        log.warning("result backend unreadable for %s: %s", req.id, exc)
        return None
    state = meta.get("status")
    if state not in (states.SUCCESS, states.FAILURE, states.REVOKED):
        return None
    return str(state), meta.get("result")


def report_revoked(task: Any, reason: str) -> None:
    """The caller sees REVOKED, as for a request Celery itself discarded."""
    req = task.request
    if not stores_results(task):
        return
    try:
        task.backend.mark_as_revoked(req.id, reason, request=req)
    except Exception as exc:  # the work is ended in the store either way
        log.warning("could not mark %s revoked in the result backend: %s", req.id, exc)


def stored_failure(task: Any, failure_json: str | None, reason: str) -> BaseException:
    """The exception a failed request ended with, rebuilt from the store."""
    if failure_json:
        try:
            exc = task.backend.exception_to_python(codec.decode(failure_json))
            if isinstance(exc, BaseException):
                return exc
        except Exception as err:  # an exception type not importable here
            log.warning("stored failure of %s not rebuilt (%s)", task.request.id, err)
    return ResilientError(f"this request already failed: {reason}")
