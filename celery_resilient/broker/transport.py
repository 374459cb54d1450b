"""kombu's Redis transport with a fetch that holds what it takes: ``Transport``.

Selected by ``Resilient(app)`` in the worker for ``redis://``, ``rediss://`` and
``sentinel://`` brokers (``resilient_reliable_fetch``). Only consuming changes:

- **Fetch.** kombu sends ``BRPOP`` and, in a later round trip, writes the message to its
  ``unacked`` hash: a SIGKILL between the two loses the message from every key. Here one
  Lua script (:data:`~celery_resilient.broker.scripts.FETCH`) pops the message, writes the
  same ``unacked`` entry kombu would, and adds the delivery tag to this incarnation's
  holding, all in one server-side step. kombu's own ``unacked`` write after delivery is
  skipped for those messages (one round trip fewer per message).
- **Waiting.** A Lua script cannot block. After a fetch that found nothing the channel waits
  with ``BLMOVE first first RIGHT RIGHT`` on the first queue key it consumes (a move of the
  tail element onto itself: nothing changes order or leaves the list), which returns as soon
  as that list has a message, or after ``resilient_fetch_wait`` seconds (a transport option,
  0.1 by default) for the other keys (further queues, priority steps); then it fetches again.
  Under load no wait happens: each fetch that finds a message is followed by another.
- **Acknowledgement.** An ack, a reject or a restore removes the tag from the holding in
  the same pipeline that removes it from ``unacked``.
- **Visibility timeout.** kombu's ``restore_visible`` still gives back messages older than
  ``visibility_timeout``, except those in a holding: the holder's death, judged by the store,
  gives them back (:mod:`celery_resilient.broker.holdings`), so a task or an ETA message
  held longer than the visibility timeout by a live worker is no longer delivered twice.

Queue keys, message format, priorities, fanout (remote control) and publishing are kombu's.
"""

from __future__ import annotations

import logging
import weakref
from queue import Empty
from time import monotonic, time
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads
from kombu.utils.uuid import uuid

from celery_resilient.broker import keys
from celery_resilient.broker.scripts import ACK_SCRIPT, FETCH_SCRIPT, is_noscript
from celery_resilient.core import identity

log = logging.getLogger(__name__)

_FETCH = "fetch"
_WAIT = "wait"
#: Above this many tags fetched and not yet delivered (which only a delivery that never
#: reached its consumer leaves behind), the set is cleared: kombu then writes ``unacked``
#: again for those few, as it always did.
_MAX_PENDING_TAGS = 10_000
#: Redis version that has BLMOVE (the wait that takes nothing).
_BLMOVE_VERSION = (6, 2)


class HoldingQoS(kombu_redis.QoS):
    """kombu's Redis ack emulation, aware of the holding the fetch already wrote."""

    def append(self, message: Any, delivery_tag: str) -> None:
        if self.channel.fetched_held(delivery_tag):
            virtual.QoS.append(self, message, delivery_tag)  # the fetch wrote ``unacked``
        else:
            super().append(message, delivery_tag)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        pipe = super()._remove_from_indices(delivery_tag, pipe)
        return pipe.srem(self.channel.holding_key, delivery_tag)

    def ack(self, delivery_tag: str) -> None:
        """kombu's ack and the holding's in one script on the channel's own client."""
        channel = self.channel
        p = channel.global_keyprefix
        ACK_SCRIPT(channel.raw_client, [p + self.unacked_key, p + self.unacked_index_key,
                                        p + channel.holding_key], [delivery_tag])
        virtual.QoS.ack(self, delivery_tag)

    def restore_unacked_once(self, stderr: Any = None) -> None:
        """kombu's restore at a channel's close, unless kombu already detached the channel's
        transport from its connection.

        Celery's reconnect after a lost broker connection collects the connection (kombu sets
        ``transport.client = None``) and then closes it: the close restores this channel's
        unacknowledged messages through a client it can no longer build and raises
        ``AttributeError`` out of the consumer, which ends the worker (a Redis restart ended
        plain and resilient workers alike). Those messages stay in ``unacked`` and in this
        incarnation's holding, which the worker gives back itself once Celery has forgotten
        them (:meth:`celery_resilient.worker.holding_sweep.HoldingSweep.reconcile_own`).
        """
        transport = self.channel.connection
        if transport is None or getattr(transport, "client", None) is None:
            log.info("broker connection collected before its channel closed: %d unacknowledged "
                     "message(s) stay held and are given back by the holding sweep",
                     len(self._delivered), extra={"action": "restore_deferred"})
            return
        super().restore_unacked_once(stderr)

    def restore_visible(self, start: int = 0, num: int | None = 10,
                        interval: int = 10) -> None:
        """kombu's visibility-timeout restore, minus what a live holder accounts for.

        Skipped: a message in another incarnation's holding (that incarnation's death, judged
        by the store, gives it back), and one this process still holds on an open channel.
        Restored as kombu always did: the rest, such as what this process fetched on a
        channel whose connection was lost (Celery can no longer acknowledge those).
        """
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        channel = self.channel
        with channel.conn_or_acquire() as client:
            ceil = time() - self.visibility_timeout
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key,
                                       self.unacked_mutex_expire):
                    raw, prefix = channel.raw_client, channel.global_keyprefix
                    page = {"offset": start, "num": num} if num else {}
                    tags = [bytes_to_str(t) for t in raw.zrange(
                        prefix + self.unacked_index_key, ceil, 0, desc=True, byscore=True,
                        **page)]
                    skip = keys.held_anywhere(raw, prefix, tags, but=channel.holding_key)
                    skip |= delivered_here()
                    for tag in tags:
                        if tag not in skip:
                            self.restore_by_tag(tag, client)
            except kombu_redis.MutexHeld:
                pass


#: The open channels of this process, whose deliveries Celery can still acknowledge.
_channels: weakref.WeakSet[Channel] = weakref.WeakSet()


def delivered_here() -> set[str]:
    """Delivery tags held by an open channel of this process (kombu's ``_delivered``)."""
    tags: set[str] = set()
    for channel in list(_channels):
        qos = getattr(channel, "_qos", None)
        if qos is not None and not channel.closed:
            tags.update(qos._delivered)
    return tags


class Channel(kombu_redis.Channel):
    """kombu's Redis channel whose fetch holds what it takes."""

    QoS = HoldingQoS
    #: Seconds an idle channel waits on its first queue key before fetching again.
    resilient_fetch_wait = 0.1

    # one name more than kombu's tuple
    from_transport_options = (  # type: ignore[assignment]
        *kombu_redis.Channel.from_transport_options, "resilient_fetch_wait"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.holding_key = keys.holding(identity.incarnation())
        self._fetched: set[str] = set()
        self._idle = False
        self._pending: tuple[str, list[str]] | None = None
        self._no_ack_queues: dict[str, bool] = {}
        self._get_no_ack = False
        self._raw: redis.Redis[bytes] | None = None
        self._can_blmove: bool | None = None
        #: The queue the last message came from: an idle channel waits on it.
        self._last_queue: str | None = None
        _channels.add(self)

    # -- what the QoS asks -------------------------------------------------------------------

    def fetched_held(self, delivery_tag: str) -> bool:
        """Whether the fetch put this delivery in the holding (and ``unacked``) already."""
        try:
            self._fetched.remove(delivery_tag)
        except KeyError:
            return False
        return True

    @property
    def raw_client(self) -> redis.Redis[bytes]:
        """A client on this channel's pool that adds no key prefix (keys come prefixed)."""
        if self._raw is None:
            self._raw = redis.Redis(connection_pool=self.pool)
        return self._raw

    # -- consuming -------------------------------------------------------------------------

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        no_ack = kwargs.get("no_ack", args[0] if args else False)
        self._no_ack_queues[queue] = bool(no_ack)
        return super().basic_consume(queue, *args, **kwargs)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        self._get_no_ack = no_ack
        try:
            return super().basic_get(queue, no_ack=no_ack, **kwargs)
        finally:
            self._get_no_ack = False

    def _fetch_call(self, queue_keys: list[str], holds: str) -> tuple[list[str], list[str]]:
        """KEYS and ARGV of :data:`~celery_resilient.broker.scripts.FETCH`."""
        p = self.global_keyprefix
        return ([p + self.unacked_key, p + self.unacked_index_key, p + self.holding_key,
                 p + keys.HOLDERS, *(p + k for k in queue_keys)],
                [repr(time()), identity.incarnation(), holds])

    def _holds(self, queues: list[str]) -> str:
        return "".join("0" if self._no_ack_queues.get(q, False) else "1"
                       for _pri in self.priority_steps for q in queues)

    def _wait_command(self, first_key: str) -> list[Any]:
        if self._can_blmove is None:
            version = str(self.raw_client.info("server").get("redis_version", "0"))
            parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
            self._can_blmove = parts >= _BLMOVE_VERSION
            if not self._can_blmove:
                log.warning("Redis %s has no BLMOVE (6.2+): an idle worker polls every %gs "
                            "instead of waking when a message arrives", version,
                            max(1, round(self.resilient_fetch_wait)),
                            extra={"action": "fetch_polls"})
        wait = float(self.resilient_fetch_wait)
        if self._can_blmove:
            key = self.global_keyprefix + first_key
            return ["BLMOVE", key, key, "RIGHT", "RIGHT", wait]
        # A list nobody pushes to: a server-side sleep that keeps the poll loop's shape.
        return ["BLPOP", self.global_keyprefix + keys.NEVER, max(1, round(wait))]

    def _brpop_start(self, timeout: float | None = None) -> None:
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        queue_keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        if self._idle:
            # Wait where the last message came from (a steady stream on one queue of several
            # wakes at once); kombu's cycle has just moved that queue to the back.
            last = self._last_queue if self._last_queue in queues else queues[0]
            command = self._wait_command(self._q_for_pri(last, self.priority_steps[0]))
            self._pending = (_WAIT, queue_keys)
        else:
            command = FETCH_SCRIPT.args(*self._fetch_call(queue_keys, self._holds(queues)))
            self._pending = (_FETCH, queue_keys)
        connection = self.client.connection
        self._in_poll = connection
        self._brpop_sent_at = monotonic()  # type: ignore[assignment]
        connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        pending, self._pending = self._pending, None
        fetching = pending is not None and pending[0] == _FETCH
        try:
            try:
                reply = self.client.parse_response(
                    self.client.connection, "EVALSHA" if fetching else "BLMOVE", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next round reconnects
                raise
            except self.ResponseError as exc:
                if not is_noscript(exc):
                    raise
                FETCH_SCRIPT.load(self.raw_client)  # the server restarted without scripts
                raise Empty() from None
            if not fetching:
                self._idle = False
                raise Empty()
            if not reply:
                self._idle = True
                raise Empty()
            self._idle = False
            assert pending is not None
            position, item, held = reply
            dest = pending[1][int(position) - 1].rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            self._last_queue = dest
            payload = self._received(item, held)
            self.connection._deliver(payload, dest)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush_reauth = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.7
            if flush_reauth is not None:
                flush_reauth()

    def _get(self, queue: str, timeout: Any = None) -> Any:
        """``basic_get``: the same held fetch, once, on one queue."""
        queue_keys = [self._q_for_pri(queue, pri) for pri in self.priority_steps]
        holds = ("0" if self._get_no_ack else "1") * len(queue_keys)
        reply = FETCH_SCRIPT(self.raw_client, *self._fetch_call(queue_keys, holds))
        expire = getattr(self, "_maybe_update_queues_expire", None)  # newer kombu only
        if expire is not None:
            with self.conn_or_acquire() as client:
                expire(client, queue)
        if not reply:
            raise Empty()
        _position, item, held = reply
        return self._received(item, held)

    def _do_restore_message(self, payload: Any, exchange: str, routing_key: str, pipe: Any,
                            leftmost: bool = False) -> None:
        """kombu's restore, under a new delivery tag: a late ack of the copy that was given
        back (a worker that was only cut off) must not delete the entry of the copy the next
        worker holds."""
        properties = payload.get("properties") if isinstance(payload, dict) else None
        if isinstance(properties, dict) and "delivery_tag" in properties:
            properties["delivery_tag"] = uuid()
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)

    def _received(self, item: bytes, held: int) -> Any:
        payload = loads(bytes_to_str(item))
        if held:
            if len(self._fetched) >= _MAX_PENDING_TAGS:
                self._fetched.clear()
            self._fetched.add(payload["properties"]["delivery_tag"])
        return payload


class Transport(kombu_redis.Transport):
    """kombu's Redis transport whose channels hold what they fetch."""

    Channel = Channel


class SentinelChannel(Channel, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """kombu's Sentinel channel whose fetch holds what it takes."""


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport whose channels hold what they fetch."""

    Channel = SentinelChannel


__all__ = ["Channel", "HoldingQoS", "SentinelChannel", "SentinelTransport", "Transport"]
