"""The Redis keys of the holdings, beside kombu's own (``unacked``, ``unacked_index``).

- ``resilient.holding.<incarnation>``: a set of the delivery tags that worker incarnation
  fetched and has not acknowledged, rejected or restored. Each tag's message is in kombu's
  ``unacked`` hash, in kombu's format.
- ``resilient.holders``: a sorted set of the incarnations with a holding, scored by the time
  of their last held fetch, so a sweeper finds them without scanning the keyspace.
- ``resilient.generation.<store digest>``: a marker per store, set once and never expiring;
  its absence says the broker lost its data (:mod:`.generation`).
- ``resilient.broker``: a token per Redis (and key prefix), set once and never expiring: two
  workers that read one token consume from one broker, whatever address each reaches it by
  (:mod:`.identity`).

Keys are given here without kombu's ``global_keyprefix``; whoever sends them adds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kombu.utils.encoding import bytes_to_str

HOLDING_PREFIX = "resilient.holding."
HOLDERS = "resilient.holders"
GENERATION = "resilient.generation"
BROKER_TOKEN = "resilient.broker"
#: A list nothing is pushed to: BLPOP on it is a server-side sleep (Redis older than 6.2).
NEVER = "resilient.never"


def holding(incarnation: str) -> str:
    return HOLDING_PREFIX + incarnation


def holders(raw: Any, prefix: str) -> dict[str, float]:
    """Incarnations with a holding, and when each last held a fetched message."""
    return {bytes_to_str(inc): float(score)
            for inc, score in raw.zrange(prefix + HOLDERS, 0, -1, withscores=True)}


def held_anywhere(raw: Any, prefix: str, tags: Sequence[str], but: str = "") -> set[str]:
    """Those of ``tags`` in some incarnation's holding (``but`` that holding key)."""
    if not tags:
        return set()
    incarnations = [inc for inc in holders(raw, prefix) if holding(inc) != but]
    if not incarnations:
        return set()
    pipe = raw.pipeline(transaction=False)
    pairs = [(inc, tag) for inc in incarnations for tag in tags]
    for inc, tag in pairs:  # SISMEMBER, not SMISMEMBER: Redis before 6.2 has only this
        pipe.sismember(prefix + holding(inc), tag)
    return {tag for (_inc, tag), flag in zip(pairs, pipe.execute(), strict=True) if flag}
