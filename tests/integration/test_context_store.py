"""Contract of ContextStore on real stores (SQLite, PostgreSQL) and real caches (Redis, LRU).

Redis is DB 9 of the machine's server with a key namespace of each test's own; tests that
stop or restart Redis use a throwaway ``redis-server`` of their own, never the shared one.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from sqlalchemy import update

from celery_resilient import (
    ContextConflict,
    ContextNotFound,
    ContextStore,
    Resilient,
    SerializationError,
    StaleClaimError,
)
from celery_resilient.core.identity import Owner
from celery_resilient.store.sql import Store
from celery_resilient.tasks.context_cache import Lookup
from celery_resilient.testing import wait_for
from celery_resilient.testing.services import ThrowawayRedis, free_port

# -- helpers --------------------------------------------------------------------------------


def make_app(store_url: str, prefix: str, cache_url: str, **conf: Any) -> Celery:
    app = Celery("ctxtest", broker="memory://", set_as_current=False)
    app.conf.update(resilient_store_url=store_url, resilient_table_prefix=prefix,
                    resilient_context_cache_url=cache_url, **conf)
    Resilient(app)
    return app


def drop_namespace(url: str, namespace: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=namespace + "*", count=500))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(params=["redis", "memory"])
def cache_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    return redis_url if request.param == "redis" else "memory://"


@pytest.fixture
def make_contexts(store: Store, store_url: str, table_prefix: str, redis_url: str
                  ) -> Iterator[Callable[..., ContextStore]]:
    made: list[ContextStore] = []

    def make(cache: str, **conf: Any) -> ContextStore:
        cs = ContextStore(make_app(store_url, table_prefix, cache, **conf))
        made.append(cs)
        return cs

    yield make
    for cs in made:
        cs.close()
        cs._rt.store.dispose()
    drop_namespace(redis_url, f"{table_prefix}ctx:")


@pytest.fixture
def contexts(make_contexts: Callable[..., ContextStore], cache_url: str) -> ContextStore:
    return make_contexts(cache_url)


# -- the contract ---------------------------------------------------------------------------


def test_create_get_put_delete(contexts: ContextStore) -> None:
    ctx = contexts.create("s1", {"user": "ada", "turns": []})
    assert (ctx.version, dict(ctx)) == (1, {"user": "ada", "turns": []})
    ctx["turns"].append("hello")
    assert ctx.save() == 2
    got = contexts.get("s1")
    assert (got.version, got["turns"]) == (2, ["hello"])
    assert contexts.put("s1", {"user": "ada", "turns": ["a", "b"]}) == 3
    assert contexts.get("s1")["turns"] == ["a", "b"]
    assert contexts.delete("s1") is True
    with pytest.raises(ContextNotFound):
        contexts.get("s1")
    assert contexts.delete("s1") is False


def test_absent_key_is_an_error_never_a_fresh_start(contexts: ContextStore) -> None:
    with pytest.raises(ContextNotFound, match="never created"):
        contexts.get("nobody")
    with pytest.raises(ContextNotFound):
        contexts.put("nobody", {"x": 1})
    with pytest.raises(ContextNotFound):
        contexts.put("nobody", {"x": 1}, expected_version=1)
    assert contexts.stats.not_found == 1
    with pytest.raises(ContextNotFound):
        contexts.get("nobody")  # nothing was created by the failed writes
    contexts.create("nobody", {"x": 0})
    with pytest.raises(ContextConflict, match="already exists"):
        contexts.create("nobody", {"x": 2})
    assert dict(contexts.get("nobody")) == {"x": 0}


def test_stale_version_conflicts_and_overwrites_nothing(contexts: ContextStore) -> None:
    contexts.create("s", {"n": 0})
    a, b = contexts.get("s"), contexts.get("s")
    a["n"] = 1
    a.save()
    b["n"] = 99
    with pytest.raises(ContextConflict, match="version 2, not 1"):
        b.save()
    assert (contexts.get("s").version, contexts.get("s")["n"]) == (2, 1)
    row = contexts.rows.read("s")
    assert row is not None and row.version == 2
    b.refresh()
    b["n"] += 1
    assert b.save() == 3
    assert contexts.get("s")["n"] == 2


def test_json_objects_only(contexts: ContextStore) -> None:
    with pytest.raises(SerializationError, match="JSON object"):
        contexts.create("j", ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(SerializationError, match="not JSON-serialisable"):
        contexts.create("j", {"f": object()})
    with pytest.raises(ContextNotFound):
        contexts.get("j")


def test_cache_miss_recovers_from_store_logged_and_counted(
        make_contexts: Callable[..., ContextStore], cache_url: str, redis_url: str,
        table_prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    writer = make_contexts(cache_url)
    writer.create("m", {"history": list(range(50))})
    if cache_url == "memory://":
        reader = make_contexts(cache_url)  # a process whose LRU never saw it
    else:
        assert drop_namespace(redis_url, f"{table_prefix}ctx:") > 0  # Redis lost everything
        reader = writer
    before = reader.stats.as_dict()
    with caplog.at_level(logging.INFO, logger="celery_resilient.tasks.context"):
        got = reader.get("m")
    assert (got.version, got["history"]) == (1, list(range(50)))
    assert reader.stats.misses_recovered == before["misses_recovered"] + 1
    recovered = [r for r in caplog.records if getattr(r, "action", "") == "context_recovered"]
    assert len(recovered) == 1 and getattr(recovered[0], "context_key", None) == "m"
    hits = reader.stats.hits
    assert reader.get("m")["history"] == list(range(50))
    assert reader.stats.hits == hits + 1, "the recovery did not repopulate the cache"


def test_concurrent_read_modify_write_loses_nothing(contexts: ContextStore) -> None:
    contexts.create("counter", {"n": 0, "by": []})
    threads, rounds = 4, 10
    conflicts = [0] * threads
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for r in range(rounds):
                while True:
                    ctx = contexts.get("counter")
                    ctx["n"] += 1
                    ctx["by"].append(f"{t}:{r}")
                    try:
                        ctx.save()
                        break
                    except ContextConflict:
                        conflicts[t] += 1
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(60)
    assert not errors, errors
    final = contexts.get("counter")
    assert final["n"] == threads * rounds
    assert sorted(final["by"]) == sorted(f"{t}:{r}" for t in range(threads) for r in range(rounds))
    assert final.version == 1 + threads * rounds
    row = contexts.rows.read("counter")
    assert row is not None and row.version == final.version
    print(f"conflicts per thread: {conflicts}")


def test_writes_from_a_superseded_execution_are_fenced(contexts: ContextStore,
                                                       store: Store) -> None:
    owner = Owner("node@test", "inc-1", 1)
    first = store.take("wk", "t", "id-1", None, owner, 30, 5, lambda *a: False)
    assert first.claim is not None
    contexts.create("f", {"v": 0})
    ctx = contexts.get("f")
    ctx._fence = ("wk", first.claim.epoch)
    ctx["v"] = 1
    assert ctx.save() == 2
    later = store.take("wk", "t", "id-1", None, Owner("node@other", "inc-2", 2), 30, 5,
                       lambda *a: False, supersedes=first.claim.epoch)
    assert later.claim is not None and later.claim.epoch == first.claim.epoch + 1
    ctx["v"] = 2
    with pytest.raises(StaleClaimError):
        ctx.save()
    assert (contexts.get("f").version, contexts.get("f")["v"]) == (2, 1)


def test_prune_removes_old_contexts_from_store_and_cache(contexts: ContextStore,
                                                         store: Store) -> None:
    contexts.create("old", {"a": 1})
    contexts.create("new", {"b": 2})
    contexts.get("old")  # cached
    assert contexts.prune() == 0  # no resilient_context_retention: keep everything
    c = store.t.contexts
    with store.begin() as conn:
        conn.execute(update(c).where(c.c.key == "old").values(updated_at=c.c.updated_at - 7200))
    assert contexts.prune(older_than=3600) == 1
    with pytest.raises(ContextNotFound):
        contexts.get("old")
    assert contexts.get("new")["b"] == 2


def test_retention_setting_drives_prune(make_contexts: Callable[..., ContextStore],
                                        cache_url: str, store: Store) -> None:
    cs = make_contexts(cache_url, resilient_context_retention=3600)
    cs.create("x", {"a": 1})
    c = store.t.contexts
    with store.begin() as conn:
        conn.execute(update(c).values(updated_at=c.c.updated_at - 7200))
    assert cs.prune() == 1


# -- Redis-specific: the cache never serves an older version than the store ----------------


@pytest.fixture
def redis_contexts(make_contexts: Callable[..., ContextStore], redis_url: str) -> ContextStore:
    return make_contexts(redis_url)


def test_writer_dying_after_commit_leaves_no_stale_cache(redis_contexts: ContextStore) -> None:
    cs = redis_contexts
    assert cs._redis is not None
    cs.create("k", {"v": 1})
    assert cs.get("k")["v"] == 1 and cs.get("k").version == 1  # cached at version 1
    cs._redis.pending_ms = 300
    cs._redis.begin("k")  # a writer begins, commits, and dies before updating the cache
    cs.rows.update("k", '{"v": 2}', 1)
    assert cs.get("k")["v"] == 2, "a stale cached version won over the store"
    hits = cs.stats.hits
    wait_for(lambda: cs.get("k").version == 2 and cs.stats.hits > hits, 10,
             "the cache to serve version 2 once the dead writer's marker expired")


def test_late_fill_from_a_slow_reader_cannot_replace_newer(redis_contexts: ContextStore) -> None:
    cs = redis_contexts
    assert cs._redis is not None
    cs.create("k", {"v": 1})
    cs._redis.invalidate("k")
    seen = cs._redis.read("k")  # reader misses and reads version 1 from the store ...
    assert not seen.hit
    cs.put("k", {"v": 2}, expected_version=1)  # ... meanwhile a writer commits version 2
    assert cs._redis.fill("k", 1, '{"v": 1}', seen) is False
    assert cs._redis.read("k").version == 2
    # Even with the writer's cache update lost, the reader cannot fill its old copy.
    cs._redis.begin("k")
    cs.rows.update("k", '{"v": 3}', 2)
    assert cs._redis.fill("k", 2, '{"v": 2}', seen) is False
    assert cs.get("k")["v"] == 3


def test_delete_then_recreate_is_not_shadowed_by_the_old_context(
        redis_contexts: ContextStore) -> None:
    cs = redis_contexts
    assert cs._redis is not None
    cs.create("k", {"gen": "old"})
    for _ in range(3):
        cs.get("k").save()
    stale = Lookup(None, None, cs._redis.read("k").token)
    old_ticket = cs._redis.begin("k")  # a writer of the old context, slow to finish
    cs._redis.end("k", old_ticket, 4, '{"gen": "old"}')
    cs.delete("k")
    cs.create("k", {"gen": "new"})
    assert cs._redis.fill("k", 4, '{"gen": "old"}', stale) is False
    cs._redis.end("k", old_ticket, 5, '{"gen": "old"}')  # finishes after the re-create
    got = cs.get("k")
    assert (got.version, got["gen"]) == (1, "new")


def test_conflict_invalidates_the_cached_entry(redis_contexts: ContextStore) -> None:
    cs = redis_contexts
    assert cs._redis is not None
    cs.create("k", {"v": 1})
    cs.get("k")
    with pytest.raises(ContextConflict):
        cs.put("k", {"v": 9}, expected_version=7)
    assert not cs._redis.read("k").hit
    assert cs.get("k")["v"] == 1


def test_writes_missed_while_redis_unreachable_are_invalidated_later(
        redis_contexts: ContextStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cs = redis_contexts
    assert cs._redis is not None
    cs.create("k", {"v": 1})
    assert cs.get("k").version == 1  # cached
    real = cs._redis._scripts["begin"]

    def unreachable(*a: Any, **kw: Any) -> Any:
        raise redis.ConnectionError("network partition")

    monkeypatch.setitem(cs._redis._scripts, "begin", unreachable)
    cs.put("k", {"v": 2}, expected_version=1)  # Redis keeps its copy of version 1
    assert cs.stats.cache_errors == 1
    assert cs.get("k")["v"] == 2  # backing off: straight to the store
    assert cs.stats.bypassed >= 1
    monkeypatch.setitem(cs._redis._scripts, "begin", real)
    cs._redis._down_until = 0.0  # the backoff is over
    got = cs.get("k")
    assert (got.version, got["v"]) == (2, 2), "Redis served the copy it kept from before"


def test_redis_down_reads_and_writes_fall_back_to_the_store(
        make_contexts: Callable[..., ContextStore],
        caplog: pytest.LogCaptureFixture) -> None:
    cs = make_contexts(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="celery_resilient.tasks.context_cache"):
        cs.create("d", {"n": 0})
        for _ in range(20):
            ctx = cs.get("d")
            ctx["n"] += 1
            ctx.save()
    elapsed = time.monotonic() - started
    assert cs.get("d")["n"] == 20
    assert cs.stats.cache_errors <= 2, "a dead Redis was retried on every call"
    assert cs.stats.bypassed >= 40
    assert any(getattr(r, "action", "") == "context_cache_down" for r in caplog.records)
    assert elapsed < 5, f"{elapsed:.1f}s for 41 operations with Redis down"


def test_hung_redis_costs_one_short_timeout(make_contexts: Callable[..., ContextStore]) -> None:
    with socket.socket() as hole:  # accepts connections, never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        cs = make_contexts(f"redis://127.0.0.1:{hole.getsockname()[1]}/0")
        cs.create("h", {"n": 1})  # pays one socket timeout, then backs off
        started = time.monotonic()
        for _ in range(20):
            assert cs.get("h")["n"] == 1
        assert time.monotonic() - started < 2
        assert cs.stats.cache_errors <= 2


def test_redis_restarted_and_stopped(make_contexts: Callable[..., ContextStore],
                                     tmp_path: Path) -> None:
    server = ThrowawayRedis().start()
    try:
        cs = make_contexts(server.url)
        cs.create("r", {"turns": ["a"]})
        ctx = cs.get("r")
        ctx["turns"].append("b")
        ctx.save()
        assert cs.get("r").version == 2 and cs.stats.hits >= 1
        server.restart()  # empty: everything cached is gone
        got = cs.get("r")
        assert (got.version, got["turns"]) == (2, ["a", "b"])
        server.stop()
        got["turns"].append("c")
        assert got.save() == 3  # Redis stopped: the write goes to the store
        assert cs.get("r")["turns"] == ["a", "b", "c"]
        server.start()
        cs._redis._down_until = 0.0  # type: ignore[union-attr]
        wait_for(lambda: cs.get("r").version == 3 and cs._redis.read("r").hit,  # type: ignore[union-attr]
                 10, "the cache to be refilled after Redis came back")
    finally:
        server.destroy()
