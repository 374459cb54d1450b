"""Wait on a condition with a deadline: the only way e2e tests wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition did not hold before its deadline."""


def wait_for(condition: Callable[[], T], timeout: float, message: str = "condition",
             interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last: T = condition()
    while not last:
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:.1f}s waiting for {message} "
                              f"(last value: {last!r})")
        time.sleep(interval)
        last = condition()
    return last
