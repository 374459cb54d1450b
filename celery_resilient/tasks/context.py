"""Continuity contexts: JSON objects kept across tasks, fast from a cache, durable in SQL.

The SQL store is the truth and is written first; the cache (Redis, or an in-process LRU)
only speeds reads. A cache miss recovers the context from the store and refills the cache
(logged as ``context_recovered`` and counted). A key in neither raises
:class:`ContextNotFound`: a context is only ever created by :meth:`ContextStore.create`,
never silently started afresh. Every write is a compare-and-set on the version, so a writer
holding an old version gets :class:`ContextConflict` and overwrites nothing.

When Redis is down, reads and writes use the store alone (logged, never failing because of
the cache). Inside a task, ``self.context(key)`` writes are fenced by the execution's claim:
a superseded (zombie) execution cannot overwrite a context.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import Any

from celery import Celery, Task

from celery_resilient.core import codec
from celery_resilient.errors import (
    ConfigurationError,
    ContextConflict,
    ContextNotFound,
    SerializationError,
)
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.contexts import ContextRows, Fence
from celery_resilient.tasks.context_cache import (
    CacheUnavailable,
    LocalContextCache,
    RedisContextCache,
)
from celery_resilient.tasks.execution import refuse_inside_atomic

log = logging.getLogger(__name__)
MAX_KEY = 200  # leaves room in the 255-char column and in Redis key names
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
MEMORY = "memory://"
_ATTR = "_celery_resilient_contexts"


@dataclass
class ContextStats:
    """Per-process counters, for metrics and tests."""

    hits: int = 0
    misses_recovered: int = 0
    not_found: int = 0
    cache_errors: int = 0
    bypassed: int = 0  # calls that skipped the cache while it was backed off

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Context(MutableMapping[str, Any]):
    """One context as read: a dict of its data plus the ``version`` it was read at.

    Change it like a dict, then :meth:`save`; the save succeeds only if nobody saved a newer
    version meanwhile (else :class:`ContextConflict`, and nothing is overwritten).
    """

    def __init__(self, owner: ContextStore, key: str, version: int, data: dict[str, Any],
                 fence: Fence | None = None) -> None:
        self.key = key
        self.version = version
        self.data = data
        self._owner = owner
        self._fence = fence

    def save(self) -> int:
        """Store the data as the next version; returns it."""
        self.version = self._owner._put(self.key, self.data, self.version, self._fence)
        return self.version

    def refresh(self) -> None:
        """Re-read the stored version (after a :class:`ContextConflict`, say)."""
        fresh = self._owner.get(self.key)
        self.version, self.data = fresh.version, fresh.data

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.data[name] = value

    def __delitem__(self, name: str) -> None:
        del self.data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"Context({self.key!r}, version={self.version}, data={self.data!r})"


class ContextStore:
    """``get``/``create``/``put``/``delete``/``prune`` of contexts for a Resilient app."""

    def __init__(self, app: Celery, *, namespace: str | None = None,
                 cache_url: str | None = None) -> None:
        self._rt = Runtime.of(app)
        cfg = self._rt.config
        self.stats = ContextStats()
        self._stats_lock = threading.Lock()
        self._rows: ContextRows | None = None
        self.cache_url = cache_url or cfg.context_cache_url or _broker_redis(app) or MEMORY
        self.namespace = namespace if namespace is not None else f"{cfg.table_prefix}ctx:"
        self._redis: RedisContextCache | None = None
        self._local: LocalContextCache | None = None
        if self.cache_url.startswith(REDIS_SCHEMES):
            self._redis = RedisContextCache(self.cache_url, self.namespace,
                                            cfg.context_cache_ttl)
        elif self.cache_url.startswith(MEMORY):
            self._local = LocalContextCache(cfg.context_cache_size, cfg.context_cache_ttl)
        else:
            raise ConfigurationError(
                f"resilient_context_cache_url={self.cache_url!r} is invalid: use a redis://, "
                f"rediss:// or unix:// URL, or {MEMORY} for an in-process cache"
            )

    @property
    def rows(self) -> ContextRows:
        if self._rows is None:
            self._rows = ContextRows(self._rt.store)
        return self._rows

    # -- public API ----------------------------------------------------------------------

    def get(self, key: str) -> Context:
        """The stored context; :class:`ContextNotFound` if it exists nowhere."""
        key = _check_key(key)
        version, text = self._get_local(key) if self._local is not None else self._get_shared(key)
        return Context(self, key, version, _as_object(codec.decode(text), key))

    def create(self, key: str, data: Mapping[str, Any]) -> Context:
        """Create ``key`` at version 1; :class:`ContextConflict` if it already exists."""
        return self._create(key, data, None)

    def put(self, key: str, data: Mapping[str, Any], expected_version: int | None = None) -> int:
        """Replace the data of an existing context; returns the new version.

        With ``expected_version`` the write happens only if the stored version still is
        that one (else :class:`ContextConflict`); with None the last writer wins. A missing
        key raises :class:`ContextNotFound`: use :meth:`create`.
        """
        return self._put(key, data, expected_version, None)

    def delete(self, key: str, expected_version: int | None = None) -> bool:
        """Delete from the store, then the cache; False if there was nothing to delete."""
        key = _check_key(key)
        return bool(self._write(key, "delete", None, expected_version, None))

    def prune(self, older_than: float | None = None) -> int:
        """Delete contexts not written for ``older_than`` seconds (default
        ``resilient_context_retention``; nothing when that is unset). Returns how many."""
        age = older_than if older_than is not None else self._rt.config.context_retention
        if age is None:
            return 0
        total = 0
        while True:
            keys = self.rows.prune(age)
            for key in keys:
                self._cache_invalidate(key)
            total += len(keys)
            if len(keys) < 1000:
                break
        if total:
            log.info("pruned %d contexts older than %.0fs", total, age,
                     extra={"action": "contexts_pruned", "count": total})
        return total

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    # -- reads ---------------------------------------------------------------------------

    def _get_shared(self, key: str) -> tuple[int, str]:
        assert self._redis is not None
        try:
            seen = self._redis.read(key)
        except CacheUnavailable as exc:
            self._count_unavailable(exc)
            return self._from_store(key, "cache unavailable")
        if seen.hit:
            self._count("hits")
            assert seen.version is not None and seen.data_json is not None
            return seen.version, seen.data_json
        version, text = self._from_store(key, "write in flight" if seen.pending else "miss")
        if not seen.pending:
            try:
                self._redis.fill(key, version, text, seen)
            except CacheUnavailable as exc:
                self._count_unavailable(exc)
        return version, text

    def _get_local(self, key: str) -> tuple[int, str]:
        assert self._local is not None
        cached = self._local.peek(key)
        row = self.rows.read(key, cached[0] if cached else None)
        if row is None:
            self._local.drop(key)
            self._count("not_found")
            raise _not_found(key)
        if cached is not None and row.data_json is None:
            self._count("hits")
            return cached
        assert row.data_json is not None
        self._local.put(key, row.version, row.data_json)
        self._recovered(key, row.version, "stale" if cached else "miss")
        return row.version, row.data_json

    def _from_store(self, key: str, why: str) -> tuple[int, str]:
        row = self.rows.read(key)
        if row is None:
            self._count("not_found")
            raise _not_found(key)
        assert row.data_json is not None
        self._recovered(key, row.version, why)
        return row.version, row.data_json

    def _recovered(self, key: str, version: int, why: str) -> None:
        self._count("misses_recovered")
        level = logging.DEBUG if why == "write in flight" else logging.INFO
        log.log(level, "context %s recovered from the store at version %d (%s)", key, version,
                why, extra={"action": "context_recovered", "context_key": key,
                            "version": version, "reason": why})

    # -- writes --------------------------------------------------------------------------

    def _create(self, key: str, data: Mapping[str, Any], fence: Fence | None) -> Context:
        key = _check_key(key)
        text = _encode(key, data)
        version = self._write(key, "create", text, None, fence)
        return Context(self, key, version, codec.decode(text), fence)

    def _put(self, key: str, data: Mapping[str, Any], expected_version: int | None,
             fence: Fence | None) -> int:
        key = _check_key(key)
        return self._write(key, "update", _encode(key, data), expected_version, fence)

    def _write(self, key: str, op: str, text: str | None, expected: int | None,
               fence: Fence | None) -> int:
        """Store first, cache after: the cache never holds what the store did not commit."""
        if fence is not None:
            refuse_inside_atomic(f"saving context {key!r}")
        if self._local is not None:
            return self._write_local(key, op, text, expected, fence)
        assert self._redis is not None
        ticket = None
        try:
            ticket = self._redis.begin(key)
        except CacheUnavailable as exc:
            self._count_unavailable(exc)
        try:
            result = self._store_write(key, op, text, expected, fence)
        except BaseException:
            if ticket is not None:
                self._cache_end(key, ticket, None, None, "invalidate")
            raise
        if ticket is not None:
            if op == "delete":
                self._cache_end(key, ticket, None, None, "delete")
            else:
                self._cache_end(key, ticket, result, text, "set")
        return result

    def _write_local(self, key: str, op: str, text: str | None, expected: int | None,
                     fence: Fence | None) -> int:
        assert self._local is not None
        self._local.drop(key)
        result = self._store_write(key, op, text, expected, fence)
        if op != "delete" and text is not None:
            self._local.put(key, result, text)
        return result

    def _store_write(self, key: str, op: str, text: str | None, expected: int | None,
                     fence: Fence | None) -> int:
        if op == "create":
            assert text is not None
            return self.rows.create(key, text, fence)
        if op == "update":
            assert text is not None
            return self.rows.update(key, text, expected, fence)
        return int(self.rows.delete(key, expected, fence))

    def _cache_end(self, key: str, ticket: Any, version: int | None, text: str | None,
                   mode: str) -> None:
        assert self._redis is not None
        try:
            self._redis.end(key, ticket, version, text, mode)
        except CacheUnavailable as exc:
            self._count_unavailable(exc)

    def invalidate(self, keys: Iterable[str]) -> None:
        """Drop ``keys`` from the fast cache (contexts deleted from the store by retention),
        so it never serves a context the durable store no longer has."""
        for key in keys:
            self._cache_invalidate(key)

    def _cache_invalidate(self, key: str) -> None:
        if self._local is not None:
            self._local.drop(key)
            return
        assert self._redis is not None
        try:
            self._redis.invalidate(key)
        except CacheUnavailable as exc:
            self._count_unavailable(exc)

    def _count_unavailable(self, exc: CacheUnavailable) -> None:
        self._count("bypassed" if exc.skipped else "cache_errors")

    def _count(self, name: str) -> None:
        with self._stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)


# -- task integration -----------------------------------------------------------------------

def for_app(app: Celery) -> ContextStore:
    """The app's shared ContextStore in this process (built on first use)."""
    store: ContextStore | None = getattr(app, _ATTR, None)
    if store is None:
        store = ContextStore(app)
        setattr(app, _ATTR, store)
    return store


def task_context(task: Task, key: str,
                 create_default: Mapping[str, Any] | None = None) -> Context:
    """``self.context(key)``: writes through the returned context are fenced by the claim.

    Without ``create_default`` a missing context raises :class:`ContextNotFound`; with it,
    the context is created explicitly from that value (or read, if another task created it
    first).
    """
    store = for_app(task.app)
    x = getattr(task.request, "resilient_execution", None)  # None for a direct call
    fence: Fence | None = (x.work_key, x.epoch) if x is not None else None
    try:
        ctx = store.get(key)
    except ContextNotFound:
        if create_default is None:
            raise
        try:
            return store._create(key, create_default, fence)
        except ContextConflict:
            ctx = store.get(key)
    ctx._fence = fence
    return ctx


# -- helpers ------------------------------------------------------------------------------

def _broker_redis(app: Celery) -> str | None:
    """The broker's URL when the broker is Redis: the default fast path, no extra service."""
    url = app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if isinstance(url, str):
        url = url.split(";")[0].strip()
        if url.startswith(REDIS_SCHEMES):
            return url
    return None


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"context key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY:
        raise ValueError(f"context key is {len(key)} chars long; the maximum is {MAX_KEY}")
    return key


def _encode(key: str, data: Mapping[str, Any]) -> str:
    if not isinstance(data, Mapping):
        raise SerializationError(
            f"context {key!r} must be a JSON object (a dict), not {type(data).__name__}")
    return codec.encode(dict(data), f"context {key!r}")


def _as_object(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SerializationError(f"context {key!r} holds {type(value).__name__}, not an object")
    return value


def _not_found(key: str) -> ContextNotFound:
    return ContextNotFound(
        f"no context is stored under {key!r} (not in the cache, not in the store); it was "
        "never created, was deleted, or was pruned by resilient_context_retention. Create "
        "contexts explicitly with create(key, data)"
    )
