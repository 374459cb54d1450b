"""Checkpoints: the durable progress of one unit of work, resumed after any restart."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from celery_resilient.core import codec, handoff, killpoints
from celery_resilient.errors import CheckpointError, SerializationError
from celery_resilient.store.sql import Resume
from celery_resilient.tasks.execution import Execution, refuse_inside_atomic

log = logging.getLogger(__name__)
_MISSING: Any = object()


class Checkpoint:
    """``load``/``save``/``clear`` for the running execution's work key.

    ``save`` is durable when it returns and fenced: a superseded execution's save raises
    :class:`StaleClaimError` and changes nothing. While the worker shuts down warm in
    hand-off mode, a save that committed ends the execution (the work continues from it on
    another worker).
    """

    def __init__(self, execution: Execution,
                 on_progress: Callable[[int, int], None] | None = None) -> None:
        self._x = execution
        self._on_progress = on_progress
        self.sequence = 0
        #: What the take read with the claim; good for the first load only (a save or
        #: clear of this execution makes it old).
        self._taken: Resume | None = execution.resume_from

    @property
    def work_key(self) -> str:
        return self._x.work_key

    def load(self, default: Any = None) -> Any:
        """The last saved state, or a copy of ``default`` when nothing was saved yet."""
        taken, self._taken = self._taken, None
        found = (taken.found if taken is not None
                 else self._x.progress.load_checkpoint(self._x.work_key))
        if found is None:
            return copy.deepcopy(default)
        text, self.sequence = found
        if self.sequence and self._x.attempts > 1:
            log.info("resuming %s from checkpoint #%d", self._x.work_key, self.sequence,
                     extra={"action": "resumed", "work_key": self._x.work_key,
                            "checkpoint_seq": self.sequence})
        return codec.decode(text, f"checkpoint #{self.sequence} of work {self._x.work_key!r}")

    def save(self, state: Any, progress: tuple[int, int] | None = None) -> int:
        """Store ``state`` durably; returns its sequence number (1, 2, ...).

        ``progress=(done, total)`` is then published as the task's ``PROGRESS`` state
        (``AsyncResult.info == {"done": done, "total": total}``, shown by Flower) when the task
        stores results; it is not part of the durable state.
        """
        refuse_inside_atomic("checkpoint.save")
        if progress is not None:
            progress = _check_progress(self._x.work_key, progress)
        try:
            text = codec.encode(state, "checkpoint state")
        except SerializationError as exc:
            raise CheckpointError(f"checkpoint for {self._x.work_key!r} not saved: {exc}") from None
        limit = self._x.config.max_checkpoint_bytes
        size = len(text.encode())
        if size > limit:
            raise CheckpointError(
                f"checkpoint for {self._x.work_key!r} not saved: {size} bytes exceeds "
                f"resilient_max_checkpoint_bytes={limit}; keep large data elsewhere and "
                "checkpoint a reference to it"
            )
        self._taken = None
        self.sequence = self._x.progress.save_checkpoint(self._x.work_key, self._x.epoch, text)
        if killpoints.ARMED:
            killpoints.reached("after_checkpoint")
        if progress is not None and self._on_progress is not None:
            self._on_progress(*progress)
        if self._x.can_hand_off and handoff.requested() and not self._revoked():
            raise handoff.HandOff(f"work {self._x.work_key!r} hands off at checkpoint "
                                  f"#{self.sequence}")
        return self.sequence

    def _revoked(self) -> bool:
        """Revoked without terminate: it runs to its end, as in Celery (a handed-off copy
        would be discarded as revoked, leaving the work half done)."""
        if self._x.store is None or self._x.task_id is None:
            return False
        return self._x.store.is_revoked(self._x.task_id)

    def clear(self) -> None:
        refuse_inside_atomic("checkpoint.clear")
        self._taken = None
        self._x.progress.clear_checkpoint(self._x.work_key, self._x.epoch)
        self.sequence = 0


def _check_progress(work_key: str, progress: Any) -> tuple[int, int]:
    try:
        done, total = progress
    except (TypeError, ValueError):
        done = total = None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (done, total)):
        raise CheckpointError(f"checkpoint for {work_key!r} not saved: progress must be "
                              f"(done, total) non-negative integers, got {progress!r}")
    return done, total
