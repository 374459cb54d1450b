"""A tiny append-only log of side effects, the demo's witness of "happened exactly once".

Independent of the store: each effect is one JSON line appended with ``O_APPEND`` and fsync'd,
so it survives a SIGKILL right after ``record`` returns and lines from processes never mix.
(The same idea as ``celery_resilient.testing.EffectLog``, without the test dependencies.)
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
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(entry, default=str) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self, name: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open() as fh:
            found = [json.loads(line) for line in fh if line.strip()]
        return found if name is None else [e for e in found if e["effect"] == name]

    def counts(self) -> Counter[str]:
        return Counter(e["effect"] for e in self.entries())
