"""An effect log independent of the store: the witness for "applied exactly once".

Each effect is one line appended with ``O_APPEND`` and fsync'd, so lines from concurrent
processes never interleave and survive a SIGKILL right after ``record`` returns.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any


class EffectLog:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def record(self, name: str, **details: Any) -> None:
        entry = {"effect": name, "pid": os.getpid(), "ts": time.time(), **details}
        line = json.dumps(entry, default=str) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every recorded effect in order (only those called ``name`` when given)."""
        if not self.path.exists():
            return []
        with self.path.open() as fh:
            found = [json.loads(line) for line in fh if line.strip()]
        return found if name is None else [e for e in found if e["effect"] == name]

    def counts(self) -> Counter[str]:
        return Counter(e["effect"] for e in self.entries())

    def count(self, name: str) -> int:
        return self.counts()[name]

    def assert_exactly_once(self, names: list[str] | set[str]) -> None:
        counts = self.counts()
        wrong = {n: counts[n] for n in names if counts[n] != 1}
        assert not wrong, f"effects not applied exactly once (name: times): {wrong}"
        extra = set(counts) - set(names)
        assert not extra, f"unexpected effects recorded: {sorted(extra)[:20]}"
