"""One fenced execution of a unit of work: what checkpoints, steps and the ledger write with."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ResilientConfig
from .store.sql import Store


@dataclass(frozen=True)
class Execution:
    store: Store
    config: ResilientConfig
    work_key: str
    epoch: int
    attempts: int
