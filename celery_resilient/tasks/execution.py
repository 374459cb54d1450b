"""One fenced execution of a unit of work: what checkpoints, steps and the ledger write with.

A task called directly (``add(1, 2)``, as unit tests do) has no claim: it runs on a
:class:`ScratchProgress`, an in-memory stand-in that starts empty and is forgotten when the
call returns, exactly like a plain function call. Its ledger still uses the real store,
because ledger keys are global (see ``ResumableTask.ledger``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from celery_resilient.errors import ResilientError
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.store.sql import Resume, Store

#: The ledger key of the ``ledger.atomic()`` block open in this context, if any.
_open_atomic: ContextVar[str | None] = ContextVar("resilient_open_atomic", default=None)


@contextmanager
def atomic_open(key: str) -> Iterator[None]:
    """Mark a ``ledger.atomic()`` block as open while its transaction is."""
    token = _open_atomic.set(key)
    try:
        yield
    finally:
        _open_atomic.reset(token)


def refuse_inside_atomic(what: str) -> None:
    """A fenced write on its own connection inside ``ledger.atomic()`` would wait for ever on
    PostgreSQL (the block's transaction holds the claim row it must lock) and for the busy
    timeout on SQLite; and a hand-off at a checkpoint saved there would be rolled back with
    the block. Refuse it with an error that says what to do instead."""
    key = _open_atomic.get()
    if key is not None:
        raise ResilientError(
            f"{what} inside ledger.atomic({key!r}) is not supported: it needs the claim row "
            "the block's transaction holds. Write through tx.execute(...) inside the block, "
            "and save checkpoints, steps, contexts and other ledger keys after it (the "
            "block's marker makes a replay skip it)")


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
    #: The Celery request this execution serves (None for a direct call).
    task_id: str | None = None
    #: The checkpoint to resume from as the take read it: the first ``load`` needs no round
    #: trip (None: not read, ``load`` asks the store).
    resume_from: Resume | None = None
    #: Taken by the worker's main process (batched takes): the finish need not wait for the
    #: WAL flush, that process flushes before it acknowledges.
    handed: bool = False
    #: The generation of handed claims when this one was received (``tasks/handed_claims.py``):
    #: while it and the lease hold, no other worker can own the claim.
    handed_generation: int | None = None

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
