"""Fast-path caches for contexts: Redis (shared) or an in-process LRU. Never the truth.

The store is the truth; a cache entry only ever holds a version the store committed, and
the protocol below makes sure an older version can never replace a newer one:

- Each Redis entry is a hash ``{v: version, d: data, g: generation, i: incarnation}`` and a
  write-in-flight marker ``<entry>:w`` that expires by itself.
- A writer first drops the data, sets a fresh generation and the marker (``begin``), commits
  to the store, then (``end``) sets its version only if it is newer than what is cached and
  no delete happened meanwhile, and removes the marker if it is still its own.
- A reader that missed fills the entry only if no write began since its miss (same
  generation), no write is in flight (no marker) and nothing newer is cached.
- A writer that dies between its commit and ``end`` leaves no data behind: readers go to the
  store until its marker expires, then fill from the store.

Redis errors raise :class:`CacheUnavailable`. After one, the cache is skipped for a backoff
period (so a dead Redis costs one short timeout, not one per call), and keys written
meanwhile are invalidated when Redis answers again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

SOCKET_TIMEOUT = 0.25  # seconds: a dead or hung Redis costs at most this per attempt
BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
PENDING_SECONDS = 30.0  # how long a dead writer's marker keeps readers on the store
MAX_DIRTY = 10_000


class CacheUnavailable(Exception):
    """The cache cannot be used right now; callers go to the store.

    ``skipped``: Redis was not even tried (backing off after an earlier error).
    """

    def __init__(self, message: str, skipped: bool = False) -> None:
        super().__init__(message, skipped)
        self.skipped = skipped


@dataclass(frozen=True)
class Lookup:
    """A cache read: the cached version/data (None on a miss) and the state seen for fills."""

    version: int | None
    data_json: str | None
    token: tuple[str, str] = ("", "")
    pending: bool = False

    @property
    def hit(self) -> bool:
        return self.version is not None and self.data_json is not None and not self.pending


@dataclass(frozen=True)
class Ticket:
    """What ``begin`` hands to ``end``: this write's token and the incarnation it saw."""

    token: str
    incarnation: str


# -- Redis --------------------------------------------------------------------------------

_READ = """
local h = redis.call('HMGET', KEYS[1], 'v', 'd', 'g', 'i')
return {h[1], h[2], h[3], h[4], redis.call('EXISTS', KEYS[2])}
"""

_FILL = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local h = redis.call('HMGET', KEYS[1], 'v', 'g', 'i')
if (h[2] or '') ~= ARGV[3] or (h[3] or '') ~= ARGV[4] then return 0 end
if h[1] and tonumber(h[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'd', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

_BEGIN = """
redis.call('HDEL', KEYS[1], 'v', 'd')
redis.call('HSET', KEYS[1], 'g', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return redis.call('HGET', KEYS[1], 'i') or ''
"""

# ARGV: token, seen incarnation, version, data, ttl ms, mode (set | delete | invalidate)
_END = """
local i = redis.call('HGET', KEYS[1], 'i') or ''
if ARGV[6] == 'set' then
  if i == ARGV[2] then
    local v = redis.call('HGET', KEYS[1], 'v')
    if not v or tonumber(v) < tonumber(ARGV[3]) then
      redis.call('HSET', KEYS[1], 'v', ARGV[3], 'd', ARGV[4])
      redis.call('PEXPIRE', KEYS[1], ARGV[5])
    end
  end
else
  redis.call('HDEL', KEYS[1], 'v', 'd')
  redis.call('HSET', KEYS[1], 'g', ARGV[1] .. ':x')
  if ARGV[6] == 'delete' then redis.call('HSET', KEYS[1], 'i', ARGV[1]) end
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""


class RedisContextCache:
    """The shared fast path: one Redis hash per context, guarded by Lua scripts."""

    shared = True

    def __init__(self, url: str, namespace: str, ttl: float,
                 socket_timeout: float = SOCKET_TIMEOUT) -> None:
        self.url = url
        self.namespace = namespace
        self.ttl_ms = max(1, int(ttl * 1000))
        self.pending_ms = min(self.ttl_ms, int(PENDING_SECONDS * 1000))
        self.socket_timeout = socket_timeout
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._pid = 0
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_START
        self._dirty: set[str] = set()
        self._dirty_overflow = False

    # -- the protocol ----------------------------------------------------------------------

    def read(self, key: str) -> Lookup:
        v, d, g, i, pending = self._run("read", key)
        return Lookup(None if v is None else int(v), d, (g or "", i or ""), bool(pending))

    def fill(self, key: str, version: int, data_json: str, seen: Lookup) -> bool:
        return bool(self._run("fill", key, version, data_json, seen.token[0], seen.token[1],
                              self.ttl_ms))

    def begin(self, key: str) -> Ticket:
        token = uuid.uuid4().hex
        try:
            seen = self._run("begin", key, token, self.pending_ms, self.ttl_ms)
        except CacheUnavailable:
            self._mark_dirty(key)
            raise
        return Ticket(token, seen or "")

    def end(self, key: str, ticket: Ticket, version: int | None = None,
            data_json: str | None = None, mode: str = "set") -> None:
        try:
            self._run("end", key, ticket.token, ticket.incarnation, version or 0,
                      data_json or "", self.ttl_ms, mode)
        except CacheUnavailable:
            self._mark_dirty(key)
            raise

    def invalidate(self, key: str) -> None:
        self.end(key, Ticket(uuid.uuid4().hex, ""), mode="invalidate")

    def entry_key(self, key: str) -> str:
        """The Redis key of a context; ``{}`` keeps the entry and its marker in one slot."""
        return f"{self.namespace}{{{key}}}"

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = None

    # -- plumbing ----------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _connect(self) -> Any:
        pid = os.getpid()
        if self._client is None or self._pid != pid:
            with self._lock:
                if self._client is None or self._pid != pid:
                    # optional dependency (the redis extra): imported only with a Redis URL
                    import redis  # noqa: PLC0415
                    from redis.backoff import NoBackoff  # noqa: PLC0415
                    from redis.retry import Retry  # noqa: PLC0415

                    client = redis.Redis.from_url(
                        self.url, socket_timeout=self.socket_timeout,
                        socket_connect_timeout=self.socket_timeout,
                        retry=Retry(NoBackoff(), 0), decode_responses=True,
                    )
                    self._scripts = {name: client.register_script(src) for name, src in
                                     (("read", _READ), ("fill", _FILL), ("begin", _BEGIN),
                                      ("end", _END))}
                    self._client, self._pid = client, pid
        return self._client

    def _run(self, script: str, key: str, *args: Any) -> Any:
        import redis  # noqa: PLC0415  (optional dependency: the redis extra)

        if not self.available:
            raise CacheUnavailable("backing off after an error", skipped=True)
        entry = self.entry_key(key)
        try:
            self._connect()
            if self._dirty:
                self._flush_dirty()
            result = self._scripts[script](keys=[entry, entry + ":w"], args=list(args))
        except (redis.RedisError, OSError) as exc:
            self._went_down(exc)
            raise CacheUnavailable(str(exc)) from exc
        if self._backoff > BACKOFF_START:
            log.info("context cache %s answers again", self.namespace,
                     extra={"action": "context_cache_up"})
            self._backoff = BACKOFF_START
        return result

    def _went_down(self, exc: BaseException) -> None:
        wait = self._backoff
        self._down_until = time.monotonic() + wait
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        log.warning("context cache unavailable (%s: %s); using the store only for %.0fs",
                    type(exc).__name__, exc, wait, extra={"action": "context_cache_down"})

    def _mark_dirty(self, key: str) -> None:
        """Remember a key written while Redis was unreachable, to invalidate it later."""
        with self._lock:
            if len(self._dirty) < MAX_DIRTY:
                self._dirty.add(key)
            elif not self._dirty_overflow:
                self._dirty_overflow = True
                log.warning("more than %d contexts written while the cache was down; older "
                            "cached copies of the rest expire with resilient_context_cache_ttl",
                            MAX_DIRTY, extra={"action": "context_cache_dirty_overflow"})

    def _flush_dirty(self) -> None:
        with self._lock:
            keys, self._dirty, self._dirty_overflow = self._dirty, set(), False
        try:
            for key in keys:
                entry = self.entry_key(key)
                self._scripts["end"](keys=[entry, entry + ":w"],
                                     args=[uuid.uuid4().hex, "", 0, "", self.ttl_ms,
                                           "invalidate"])
        except BaseException:
            with self._lock:
                self._dirty |= keys
            raise
        if keys:
            log.info("invalidated %d cached contexts written while the cache was down",
                     len(keys), extra={"action": "context_cache_invalidated"})


# -- in-process -------------------------------------------------------------------------

class LocalContextCache:
    """An LRU in this process. Other processes write too, so every hit is confirmed by the
    store (one indexed read of the version); what it saves is moving and decoding data."""

    shared = False

    def __init__(self, size: int, ttl: float) -> None:
        self.size = size
        self.ttl = ttl
        self._items: OrderedDict[str, tuple[int, str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def peek(self, key: str) -> tuple[int, str] | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            if item[2] < time.monotonic():
                del self._items[key]
                return None
            self._items.move_to_end(key)
            return item[0], item[1]

    def put(self, key: str, version: int, data_json: str) -> None:
        with self._lock:
            self._items[key] = (version, data_json, time.monotonic() + self.ttl)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def drop(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)
