"""Giving held messages back to their queues: a gone incarnation's, or one's own forgotten.

Who is gone is not decided here: the store judges incarnations (stopped, proven dead, lease
expired) and the worker's sweep calls :func:`restore` for those. Each message goes back
through kombu's own ``restore_by_tag`` (one transaction: out of ``unacked``, onto the front
of its queue, marked redelivered), then leaves the holding; a crash between the two leaves
a tag whose message is already back, which the next restore drops.

**Order.** A holding goes back in the order it was fetched (:func:`restore_order`): each
restore pushes its message onto the front of its queue, so the last fetched goes first and
the first fetched ends at the front, where the next fetch takes it. kombu's own
``restore_unacked`` (a clean close) and RabbitMQ's requeue keep that order too. It is what
puts a dead worker's *started* work ahead of what it had only prefetched: every pool hands
requests to its slots in the order they were delivered (prefork's fair scheduling, the
threads pool's queue, gevent's and eventlet's spawn, solo inline), so what a worker still
holds and started is always fetched before what it holds and had not started yet. Given back
by delivery tag (random), a restarted worker's first fetches mixed the two, and its pool
ran never-started work while the killed work waited for a slot (threads -c 4: 4-8 s).
Messages whose fetch time is unknown (no ``unacked_index`` score) go behind the others.

Works on any kombu Redis channel (kombu's own included), so a worker that opted out of the
reliable fetch still gives back the holdings of those that did not.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import time
from typing import Any

from kombu.utils.encoding import bytes_to_str

from celery_resilient.broker import keys
from celery_resilient.broker.scripts import FORGET_EMPTY_SCRIPT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """One tag in a holding: its task id and name (Celery's ``id`` and ``task`` headers) and
    fetch time, and whether its message is still in ``unacked`` (not once acknowledged or
    restored: the tag is then only left over)."""

    tag: str
    task_id: str | None
    task_name: str | None
    fetched_at: float | None
    present: bool


def is_redis(channel: Any) -> bool:
    """Whether ``channel`` is a kombu Redis channel (the only kind with holdings)."""
    return hasattr(channel, "unacked_key") and hasattr(channel, "qos") and hasattr(
        channel.qos, "restore_by_tag")


def raw_client(channel: Any) -> Any:
    """A client on the channel's pool that adds no key prefix."""
    raw = getattr(channel, "raw_client", None)
    if raw is not None:
        return raw
    import redis  # noqa: PLC0415  (optional dependency: only a Redis channel gets here)

    return redis.Redis(connection_pool=channel.pool)


def holders(channel: Any) -> dict[str, float]:
    """Incarnations with a holding, and when each last held a fetched message."""
    return keys.holders(raw_client(channel), channel.global_keyprefix)


def held(channel: Any, incarnation: str) -> list[Held]:
    """What ``incarnation`` holds now, with each message's task id (Celery's ``id`` header)."""
    raw, prefix = raw_client(channel), channel.global_keyprefix
    tags = sorted(bytes_to_str(t) for t in raw.smembers(prefix + keys.holding(incarnation)))
    if not tags:
        return []
    pipe = raw.pipeline(transaction=False)
    pipe.hmget(prefix + channel.unacked_key, tags)
    for tag in tags:
        pipe.zscore(prefix + channel.unacked_index_key, tag)
    entries, *scores = pipe.execute()
    return [Held(tag, *_task_of(entry), None if score is None else float(score),
                 entry is not None)
            for tag, entry, score in zip(tags, entries, scores, strict=True)]


def restore(channel: Any, incarnation: str, tags: Iterable[str] | None = None,
            older_than: float | None = None,
            only: Callable[[Held], bool] | None = None) -> list[Held]:
    """Give back what ``incarnation`` holds (only ``tags``, only messages fetched before
    ``older_than``, only those ``only`` accepts, where given); return the messages that went
    back to a queue."""
    raw, prefix = raw_client(channel), channel.global_keyprefix
    holding = prefix + keys.holding(incarnation)
    wanted = None if tags is None else set(tags)
    back: list[Held] = []
    for item in restore_order(held(channel, incarnation)):
        if wanted is not None and item.tag not in wanted:
            continue
        if older_than is not None and item.fetched_at is not None and (
                item.fetched_at >= older_than):
            continue
        if only is not None and item.present and not only(item):
            continue
        if item.present:
            channel.qos.restore_by_tag(item.tag)
            back.append(item)
        raw.srem(holding, item.tag)
    if wanted is None and older_than is None and only is None:
        FORGET_EMPTY_SCRIPT(raw, [holding, prefix + keys.HOLDERS], [incarnation])
    return back


def restore_order(items: Iterable[Held]) -> list[Held]:
    """The order in which to give ``items`` back so that their queue's front reads as they
    were fetched: each restore goes onto the front, so the last fetched goes first and the
    first fetched last. Those with no fetch time go before all others, so they end up
    behind them; ties (one clock reading) end up in the order of their tags."""
    return sorted(items, key=lambda h: (h.fetched_at is None, h.fetched_at or 0.0, h.tag),
                  reverse=True)


def forget_empty(channel: Any, incarnation: str) -> None:
    """Drop ``incarnation`` from the holders registry if its holding is empty."""
    raw, prefix = raw_client(channel), channel.global_keyprefix
    FORGET_EMPTY_SCRIPT(raw, [prefix + keys.holding(incarnation), prefix + keys.HOLDERS],
                        [incarnation])


def visibility_ceiling(channel: Any) -> float:
    """Fetched before this time, a message is past kombu's visibility timeout."""
    return time() - float(channel.visibility_timeout)


def _task_of(entry: bytes | None) -> tuple[str | None, str | None]:
    """Celery's ``id`` and ``task`` headers of an ``unacked`` entry (protocol 2)."""
    if entry is None:
        return None, None
    try:
        headers = json.loads(bytes_to_str(entry))[0].get("headers", {})
        task_id, name = headers.get("id"), headers.get("task")
    except (ValueError, TypeError, IndexError, AttributeError):
        return None, None
    return (task_id if isinstance(task_id, str) else None,
            name if isinstance(name, str) else None)


__all__ = ["Held", "forget_empty", "held", "holders", "is_redis", "raw_client", "restore",
           "restore_order", "visibility_ceiling"]
