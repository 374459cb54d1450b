"""Checkpoints: the durable progress of one unit of work, resumed after any restart."""

from __future__ import annotations

import copy
import logging
from typing import Any

from . import codec
from .errors import CheckpointError, SerializationError
from .execution import Execution
from .testing import killpoints

log = logging.getLogger(__name__)
_MISSING: Any = object()


class Checkpoint:
    """``load``/``save``/``clear`` for the running execution's work key.

    ``save`` is durable when it returns and fenced: a superseded execution's save raises
    :class:`StaleClaimError` and changes nothing.
    """

    def __init__(self, execution: Execution) -> None:
        self._x = execution
        self.sequence = 0

    @property
    def work_key(self) -> str:
        return self._x.work_key

    def load(self, default: Any = None) -> Any:
        """The last saved state, or a copy of ``default`` when nothing was saved yet."""
        found = self._x.store.load_checkpoint(self._x.work_key)
        if found is None:
            return copy.deepcopy(default)
        text, self.sequence = found
        if self.sequence and self._x.attempts > 1:
            log.info("resuming %s from checkpoint #%d", self._x.work_key, self.sequence,
                     extra={"action": "resumed", "work_key": self._x.work_key,
                            "checkpoint_seq": self.sequence})
        return codec.decode(text)

    def save(self, state: Any) -> int:
        """Store ``state`` durably; returns its sequence number (1, 2, ...)."""
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
        self.sequence = self._x.store.save_checkpoint(self._x.work_key, self._x.epoch, text)
        if killpoints.ARMED:
            killpoints.reached("after_checkpoint")
        return self.sequence

    def clear(self) -> None:
        self._x.store.clear_checkpoint(self._x.work_key, self._x.epoch)
        self.sequence = 0
