"""Durable steps: a named piece of a task that runs once per work key, its result memoized."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from celery_resilient.core import codec, killpoints
from celery_resilient.errors import ResilientError
from celery_resilient.tasks.execution import Execution, refuse_inside_atomic

log = logging.getLogger(__name__)
R = TypeVar("R")


def run_step(x: Execution, name: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """Return the stored result of step ``name``, or run ``fn`` and store its result.

    The result is recorded (fenced) right after ``fn`` returns. A crash between the two
    runs ``fn`` again on the replay: make ``fn`` idempotent for effects outside the store
    (pass ``self.fencing_token`` or the work key to the other system) or use the ledger's
    ``atomic()`` when the effect is a write to the store's own database.
    """
    refuse_inside_atomic(f"step {name!r}")
    if not isinstance(name, str) or not name or len(name) > 255:
        raise ResilientError(f"step name must be a non-empty string of <= 255 chars, got {name!r}")
    stored = x.progress.get_step(x.work_key, name)
    if stored is not None:
        log.info("step %s of %s already applied; returning its stored result", name, x.work_key,
                 extra={"action": "step_replayed", "work_key": x.work_key, "step": name})
        result: R = codec.decode(stored, f"stored result of step {name!r} of work {x.work_key!r}")
        return result
    x.progress.assert_current(x.work_key, x.epoch)  # a known zombie never starts the effect
    result = fn(*args, **kwargs)
    if killpoints.ARMED:
        killpoints.reached("after_effect")
    x.progress.put_step(x.work_key, x.epoch, name, codec.encode(result, f"result of step {name!r}"))
    if killpoints.ARMED:
        killpoints.reached("after_step")
    return result
