"""What every dialect's liveness lock does with its session once it holds it: ping, drop.

The lock itself differs (a PostgreSQL advisory lock, a MySQL named lock: ``liveness.py``,
``liveness_mysql.py``); keeping a session answering, and letting it go, do not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from celery_resilient.store import deadlines
from celery_resilient.store.engine import sanitize_url

log = logging.getLogger(__name__)


class HeldSession:
    """A connection of its own (never pooled) that holds a session-level lock; subclasses
    open it and take the lock (``acquire``), and name how to read the server's start."""

    engine: Engine
    #: Seconds a round trip on the session may go unanswered before it counts as lost.
    deadline: float
    #: The server start the lock was taken on (None: not held).
    server: float | None
    last_ok: float
    _conn: Connection | None
    #: How this dialect reads its server's start time on a connection.
    read_server_start: Callable[[Connection], float]

    def __init__(self, url: str, key: int, deadline: float, engine_url: str | URL,
                 connect_args: dict[str, Any]) -> None:
        self.url = url
        self.key = key
        self.deadline = deadline
        self.engine = create_engine(engine_url, poolclass=NullPool,
                                    isolation_level="AUTOCOMMIT", connect_args=connect_args)
        deadlines.install(self.engine)
        self._conn = None
        self.server = None
        self.last_ok = 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({sanitize_url(self.url)!r}, key={self.key})"

    @property
    def held(self) -> bool:
        return self._conn is not None and self.server is not None

    def ping(self) -> float:
        """A round trip on the session; the server start it answers from. Raises when the
        session is gone (the lock with it)."""
        if self._conn is None:
            raise ConnectionError("the liveness session is not open")
        with deadlines.bounded(self.deadline) as scope:
            deadlines.watch(self._conn.connection.dbapi_connection)
            try:
                start = type(self).read_server_start(self._conn)
            except Exception:
                if scope is not None and scope.expired:
                    raise ConnectionError(f"the liveness session did not answer within "
                                          f"{self.deadline:g}s") from None
                raise
        self.last_ok = time.monotonic()
        return start

    def drop(self) -> None:
        """Close the session (the server frees the lock)."""
        conn, self._conn, self.server = self._conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # already broken: nothing more to free
                log.debug("closing the liveness session: %s", exc)

    def dispose(self) -> None:
        self.drop()
        self.engine.dispose()
