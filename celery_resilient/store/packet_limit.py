"""A statement larger than the MySQL server's ``max_allowed_packet`` is refused before it is sent.

The server answers such a packet with error 1153 and closes the connection, and a client
still writing it sees the connection drop (2006): both read as a store outage, so the task
would be re-sent with backoff for ever and a step's function run again on every attempt.
Measured before sending, it is bad input instead: :class:`PayloadTooLarge`, naming the store
operation, the statement's size and the server's limit, raised before anything is written.

Both MySQL drivers interpolate the bound values into the statement's text on the client,
each string quoted and its ``\\0 \\n \\r \\x1a ' " \\\\`` escaped with a backslash, once per
placeholder that names it, so the size sent is known exactly. Most statements are far
below the limit: a bound of four bytes per character (UTF-8's widest) decides them without
encoding anything.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from celery_resilient.errors import PayloadTooLarge
from celery_resilient.store import transient

#: Where each pooled connection keeps its session's ``max_allowed_packet``.
INFO_KEY = "max_allowed_packet"
#: The server's refusal of a packet over ``max_allowed_packet``.
ER_NET_PACKET_TOO_LARGE = 1153
#: The characters both drivers' escaping prefixes with a backslash.
_ESCAPED = ("\\", "'", '"', "\0", "\n", "\r", "\x1a")


def install(engine: Engine) -> None:
    """Read each new connection's packet limit; check every statement against it."""

    @event.listens_for(engine, "connect")
    def _read_limit(dbapi_conn: Any, record: Any) -> None:
        cur = dbapi_conn.cursor()
        try:
            cur.execute("SELECT @@max_allowed_packet")
            row = cur.fetchone()
        finally:
            cur.close()
        record.info[INFO_KEY] = int(row[0])

    event.listen(engine, "before_cursor_execute", listener, retval=True)


def listener(conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any,
             executemany: bool) -> tuple[str, Any]:
    """The engine's ``before_cursor_execute`` hook (``retval``: SQLAlchemy calls it as is,
    so the store's fast paths know it from a user's listener)."""
    enforce(conn, statement, parameters, executemany)
    return statement, parameters


def enforce(conn: Any, statement: str, parameters: Any, executemany: bool = False) -> None:
    """:func:`check` against ``conn``'s limit: what the fast paths call before they send on
    the driver's own cursor, which no listener sees."""
    limit = conn.info.get(INFO_KEY)
    if limit is not None:
        check(statement, parameters, executemany, int(limit))


def check(statement: str, parameters: Any, executemany: bool, limit: int) -> None:
    """Raise :class:`PayloadTooLarge` if the statement as sent would exceed ``limit`` bytes
    (an executemany's rows are sent one per statement at the most)."""
    rows: Iterable[Any] = parameters if executemany else (parameters,)
    for row in rows:
        size = size_near(statement, row, limit)
        if size > limit:
            largest = max((_sent_size(v) for v, _ in _values(statement, row)), default=0)
            raise PayloadTooLarge(
                f"store operation {transient.current_operation('a statement')!r} not run: its "
                f"statement would be {size:,} bytes (its largest value {largest:,}), over the "
                f"MySQL server's max_allowed_packet of {limit:,} bytes. Keep results, step "
                "and ledger results, checkpoints, contexts and task arguments smaller (store "
                "large data elsewhere and pass a reference), or raise max_allowed_packet on "
                "the server; nothing was written")


def size_near(statement: str, parameters: Any, limit: int) -> int:
    """The bytes ``statement`` takes as sent: a cheap bound, or the exact size once the
    bound reaches ``limit`` (a sum of these may overrate a packet, never underrate it)."""
    values = _values(statement, parameters)
    bound = 4 * len(statement) + sum(n * _bound(v) for v, n in values)
    if bound < limit:
        return bound
    # +1: the command byte
    return 1 + len(statement.encode()) + sum(n * _sent_size(v) for v, n in values)


def refused(exc: BaseException) -> PayloadTooLarge | None:
    """The server's own refusal of a packet over its limit (error 1153), when a statement got
    past :func:`check` (a driver or proxy that sends more than it counts): bad input too,
    never an outage to re-send for."""
    if transient.mysql_errno(exc) != ER_NET_PACKET_TOO_LARGE:
        return None
    return PayloadTooLarge(
        f"store operation {transient.current_operation('a statement')!r} refused by the "
        f"MySQL server: its statement is over max_allowed_packet "
        f"({transient.driver_error(exc)}); keep the values it carries smaller, or raise "
        "max_allowed_packet on the server")


def _values(statement: str, row: Any) -> list[tuple[Any, int]]:
    """Each bound value with the times the statement writes it: a named placeholder used
    twice (``%(state_json)s`` in a checkpoint save's SET and its CASE) is sent twice."""
    if row is None:
        return []
    if isinstance(row, Mapping):
        uses = _uses(statement, tuple(row))
        return [(v, uses[k]) for k, v in row.items() if uses[k]]
    if isinstance(row, (list, tuple)):
        return [(v, 1) for v in row]
    return [(row, 1)]


@functools.lru_cache(maxsize=512)
def _uses(statement: str, names: tuple[str, ...]) -> dict[str, int]:
    return {name: statement.count(f"%({name})s") for name in names}


def _bound(value: Any) -> int:
    """At least the bytes ``value`` takes in the statement, cheaply."""
    if isinstance(value, str):
        return 4 * len(value) + 2
    if isinstance(value, (bytes, bytearray, memoryview)):
        return 2 * len(value) + 10  # _binary'...', each byte escaped at the most
    return 64  # numbers, dates, NULL


def _sent_size(value: Any) -> int:
    """The bytes ``value`` takes in the statement as the driver writes it."""
    if isinstance(value, str):
        return len(value.encode()) + sum(value.count(c) for c in _ESCAPED) + 2
    return _bound(value)


__all__ = ["INFO_KEY", "check", "enforce", "install", "listener", "refused", "size_near"]
