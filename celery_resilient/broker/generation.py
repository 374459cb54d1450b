"""Whether a Redis broker lost its data: a restart without persistence, a ``FLUSHALL``, a
failover to a replica that never had our keys.

Such a broker answers again with empty queues, and nothing in it says that what was queued is
gone. A marker key, set once and never expiring, does: where it is missing, the data it lived
with is gone (or this Redis never had one: its first use by this version of the library).
Each store has a marker of its own (the key names a digest of the store and its table
prefix): apps with stores of their own often share one Redis, and each must hear of the loss.
The sweep that finds it missing tells the store, which re-sends the work it holds for a
broker copy (``Store.broker_lost``), then sets the marker again.

Not detected: a restore from an older snapshot that already held the marker, or a marker
evicted by a ``maxmemory`` policy that evicts keys without an expiry (``allkeys-*``; then
queued work is re-sent once, a duplicate the take skips). RabbitMQ keeps durable queues'
persistent messages across restarts; a node that loses them is not detected either. What
goes undetected waits for the store's hold (``resilient_submit_timeout``).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_resilient.broker import holdings, keys


class BrokerMarker:
    """The marker one store keeps in its broker, as this process last saw it."""

    def __init__(self, store: str) -> None:
        #: Names the store (its URL without credentials, and its table prefix).
        self.suffix = hashlib.sha256(store.encode()).hexdigest()[:12]
        #: The marker this process last saw (None: none yet).
        self.seen: str | None = None
        #: The broker's own token (:data:`keys.BROKER_TOKEN`) as last read; None: not a
        #: Redis broker, or not read yet.
        self.broker_token: str | None = None

    def read_broker_token(self, channel: Any) -> str | None:
        """Read the broker's token, setting one if it has none (a new or wiped Redis)."""
        if not holdings.is_redis(channel):
            return None
        key = f"{channel.global_keyprefix or ''}{keys.BROKER_TOKEN}"
        pipe = holdings.raw_client(channel).pipeline(transaction=False)
        pipe.set(key, uuid.uuid4().hex, nx=True)
        pipe.get(key)
        token = pipe.execute()[1]
        self.broker_token = None if token is None else bytes_to_str(token)
        return self.broker_token

    def missing(self, channel: Any) -> bool:
        """Whether ``channel``'s Redis has lost its marker; False for other brokers."""
        if not holdings.is_redis(channel):
            return False
        token = holdings.raw_client(channel).get(self._key(channel))
        if token is None:
            return True
        # Another one set again (another worker of this store found it missing first, and
        # told the store): adopted, as the loss was handled.
        self.seen = bytes_to_str(token)
        return False

    def lost_since_seen(self) -> bool:
        """Whether this process saw a marker before it went missing (a loss it lived
        through), rather than finding none at its first look."""
        return self.seen is not None

    def mark(self, channel: Any) -> None:
        """Set the marker again (once: another sweeper's is kept)."""
        raw, key = holdings.raw_client(channel), self._key(channel)
        raw.set(key, uuid.uuid4().hex, nx=True)
        token = raw.get(key)
        self.seen = None if token is None else bytes_to_str(token)

    def _key(self, channel: Any) -> str:
        return f"{channel.global_keyprefix or ''}{keys.GENERATION}.{self.suffix}"
