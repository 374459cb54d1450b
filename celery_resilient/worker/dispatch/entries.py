"""A request waiting in the dispatcher, with how it goes on to the pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The consumer's hand-off of a request to the pool.
Execute = Callable[[Any], None]
#: A request waiting here: the request, how to hand it to the pool, its connection's number.
Entry = tuple[Any, Execute, int]
