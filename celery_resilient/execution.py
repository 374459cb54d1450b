"""One fenced execution of a unit of work: what checkpoints, steps and the ledger write with.

A task called directly (``add(1, 2)``, as unit tests do) has no claim: it runs on a
:class:`ScratchProgress`, an in-memory stand-in that starts empty and is forgotten when the
call returns, exactly like a plain function call. Its ledger still uses the real store,
because ledger keys are global (see ``ResumableTask.ledger``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .config import ResilientConfig
from .store.sql import Store


class ProgressStore(Protocol):
    """What checkpoints and steps need from a store."""

    def load_checkpoint(self, work_key: str) -> tuple[str, int] | None: ...
    def save_checkpoint(self, work_key: str, epoch: int, state_json: str) -> int: ...
    def clear_checkpoint(self, work_key: str, epoch: int) -> None: ...
    def get_step(self, work_key: str, name: str) -> str | None: ...
    def put_step(self, work_key: str, epoch: int, name: str, result_json: str) -> None: ...
    def assert_current(self, work_key: str, epoch: int) -> None: ...


@dataclass
class ScratchProgress:
    """Checkpoints and steps of one direct call, in memory; nothing to fence."""

    checkpoint: tuple[str, int] | None = None
    steps: dict[str, str] = field(default_factory=dict)

    def load_checkpoint(self, work_key: str) -> tuple[str, int] | None:
        return self.checkpoint

    def save_checkpoint(self, work_key: str, epoch: int, state_json: str) -> int:
        seq = (self.checkpoint[1] if self.checkpoint else 0) + 1
        self.checkpoint = (state_json, seq)
        return seq

    def clear_checkpoint(self, work_key: str, epoch: int) -> None:
        self.checkpoint = None

    def get_step(self, work_key: str, name: str) -> str | None:
        return self.steps.get(name)

    def put_step(self, work_key: str, epoch: int, name: str, result_json: str) -> None:
        self.steps[name] = result_json

    def assert_current(self, work_key: str, epoch: int) -> None:
        return None


@dataclass(frozen=True)
class Execution:
    """A claimed execution (``store`` set, fenced by ``epoch``) or a direct call (no store)."""

    store: Store | None
    config: ResilientConfig
    work_key: str
    epoch: int
    attempts: int
    scratch: ScratchProgress | None = None
    #: Whether this execution may hand its work off at a warm shutdown (a worker's, with a
    #: message to re-publish; not eager mode, apply() or a direct call).
    can_hand_off: bool = False

    @property
    def direct(self) -> bool:
        return self.store is None

    @property
    def progress(self) -> ProgressStore:
        """Where checkpoints and steps go: the store, or memory for a direct call."""
        if self.store is not None:
            return self.store
        assert self.scratch is not None
        return self.scratch

    @classmethod
    def for_direct_call(cls, config: ResilientConfig, work_key: str) -> Execution:
        return cls(None, config, work_key, 0, 1, ScratchProgress())
