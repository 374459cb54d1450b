"""Pure parts of the continuity context: cache choice, the LRU, the dict-like handle, stats."""

from __future__ import annotations

import pickle
import time

import pytest
from celery import Celery

from celery_resilient import (
    ConfigurationError,
    ContextConflict,
    ContextStore,
    Resilient,
    ResilientConfig,
    SerializationError,
)
from celery_resilient.tasks.context import Context, ContextStats, _check_key, _encode
from celery_resilient.tasks.context_cache import CacheUnavailable, LocalContextCache, Lookup


def app_with(broker: str, tmp_path: object, **conf: object) -> Celery:
    app = Celery("unit", broker=broker, set_as_current=False)
    app.conf.update(resilient_store_url=f"sqlite:///{tmp_path}/s.db", **conf)
    Resilient(app)
    return app


@pytest.mark.parametrize(("broker", "setting", "expected"), [
    ("redis://127.0.0.1:6379/3", None, "redis://127.0.0.1:6379/3"),
    ("rediss://h:6380/0;redis://h2:6379/0", None, "rediss://h:6380/0"),
    ("amqp://guest@localhost//", None, "memory://"),
    ("redis://127.0.0.1:6379/3", "memory://", "memory://"),
    ("amqp://guest@localhost//", "redis://cache:6379/1", "redis://cache:6379/1"),
])
def test_cache_defaults_to_the_brokers_redis(tmp_path: object, broker: str,
                                             setting: str | None, expected: str) -> None:
    conf = {} if setting is None else {"resilient_context_cache_url": setting}
    cs = ContextStore(app_with(broker, tmp_path, **conf))
    assert cs.cache_url == expected
    assert (cs._redis is not None) == expected.startswith("redis")


def test_invalid_cache_url_fails_at_construction(tmp_path: object) -> None:
    app = app_with("memory://", tmp_path, resilient_context_cache_url="memcached://x")
    with pytest.raises(ConfigurationError, match="resilient_context_cache_url"):
        ContextStore(app)


def test_namespace_follows_the_table_prefix(tmp_path: object) -> None:
    cs = ContextStore(app_with("redis://127.0.0.1:6379/9", tmp_path,
                               resilient_table_prefix="acme_"))
    assert cs._redis is not None
    assert cs._redis.entry_key("s:1") == "acme_ctx:{s:1}"


def test_lru_evicts_least_recent_and_expires() -> None:
    lru = LocalContextCache(size=2, ttl=60)
    lru.put("a", 1, "{}")
    lru.put("b", 1, "{}")
    assert lru.peek("a") == (1, "{}")  # a is now the most recent
    lru.put("c", 1, "{}")
    assert lru.peek("b") is None and lru.peek("a") is not None and len(lru) == 2
    short = LocalContextCache(size=2, ttl=0.01)
    short.put("a", 3, "{}")
    time.sleep(0.02)
    assert short.peek("a") is None


def test_lookup_hit_needs_data_and_no_write_in_flight() -> None:
    assert Lookup(2, "{}").hit
    assert not Lookup(None, None).hit
    assert not Lookup(2, None).hit
    assert not Lookup(2, "{}", pending=True).hit


def test_context_is_a_mutable_mapping_with_a_version(tmp_path: object) -> None:
    cs = ContextStore(app_with("memory://", tmp_path))
    ctx = Context(cs, "k", 4, {"a": 1})
    ctx["b"] = 2
    del ctx["a"]
    assert dict(ctx) == {"b": 2} and len(ctx) == 1 and ctx.version == 4
    assert "version=4" in repr(ctx)


def test_keys_and_values_are_checked() -> None:
    for bad in ("", None, "x" * 201):
        with pytest.raises(ValueError):
            _check_key(bad)
    with pytest.raises(SerializationError, match="JSON object"):
        _encode("k", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(SerializationError):
        _encode("k", {"x": {1, 2}})
    assert _encode("k", {"x": [1, "y", None]}) == '{"x": [1, "y", null]}'


def test_stats_and_errors_survive_pickling() -> None:
    stats = ContextStats(hits=2, cache_errors=1)
    assert stats.as_dict() == {"hits": 2, "misses_recovered": 0, "not_found": 0,
                               "cache_errors": 1, "bypassed": 0}
    err = pickle.loads(pickle.dumps(ContextConflict("context 'k' is at version 3, not 2")))
    assert str(err) == "context 'k' is at version 3, not 2"
    assert CacheUnavailable("x", skipped=True).skipped


@pytest.mark.parametrize(("key", "value"), [("resilient_context_cache_url", "memcached://x"),
                                            ("resilient_context_retention", -5)])
def test_invalid_context_settings_fail_at_startup(key: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=key):
        ResilientConfig.from_mapping({key: value})
