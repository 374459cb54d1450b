"""ResilientScheduler: RedBeat with durable slot records and exactly-once catch-up.

RedBeat keeps deciding *when* to look at an entry (its Redis zset, its lock, its entries and
settings). This class decides *what* to send: every slot between the entry's durable marker
(SQL) and now, by the entry's catch-up policy, each slot claimed in the store before it is
published with a task id and work key derived from (entry, slot). Redis meta ``last_run_at``
is the last slot (not the send time), so RedBeat's due time stays on the schedule's grid.

Recovery, each logged with ``extra={"action": ...}``:

- ``lock_takeover``: the lock's holder is provably dead (same host); the lock is freed at once.
- ``reconciled``: on start and after every lock takeover, markers are checked against Redis.
- ``entry_rehydrated`` / ``entry_removed``: an entry lost from Redis is re-created from the
  store; a dynamic entry deleted through RedBeat is forgotten.
- ``slot_caught_up`` / ``slot_skipped`` / ``slots_dropped``: a missed slot sent or skipped.
- ``slot_resent``: a slot claimed but not recorded sent (a crash before or after the publish)
  is sent again with its task id; a copy that arrives twice runs once (a ``ResumableTask`` by its
  work key, a plain task by the slot's ``started`` record: :mod:`celery_resilient.beat.once`).
- ``duplicate_refused``: a slot another beat already claimed or sent is not sent again.
- ``store_unavailable``: the store is down; beat backs off and retries, sending nothing.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from datetime import tzinfo
from typing import Any

from celery import Celery
from redbeat.schedulers import RedBeatScheduler, RedBeatSchedulerEntry, ensure_conf, get_redis

from celery_resilient.beat import entries, windows
from celery_resilient.beat.firing import SEND_BATCH, Firing, Publish, build_sender
from celery_resilient.beat.killpoints import (
    KILL_AFTER_CLAIM_ENV,
    KILL_AFTER_PUBLISH_ENV,
    KILL_AFTER_PUBLISH_NTH_ENV,
)
from celery_resilient.beat.lock import LockKeeper, default_timeout
from celery_resilient.beat.policy import CatchupPolicy
from celery_resilient.beat.resend import Resender
from celery_resilient.beat.slot_ids import task_id_for, work_key_for
from celery_resilient.beat.state import BeatState
from celery_resilient.beat.windows import US, from_seconds, from_us, to_seconds, to_us
from celery_resilient.core import liveness
from celery_resilient.errors import ConfigurationError, ScheduleError, StoreUnavailable
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.schedule import ScheduleStore

log = logging.getLogger(__name__)

PENDING_EVERY = 5.0  # look for claimed-but-unsent slots this often
SYNC_EVERY = 30.0  # record definitions of entries added through RedBeat's API
PRUNE_EVERY = 3600.0
RECORD_SKIPS = 1000  # at least this many of a window's latest slots are recorded when skipped

class ResilientScheduler(RedBeatScheduler):  # type: ignore[misc]
    """``beat_scheduler = "celery_resilient.beat:ResilientScheduler"``.

    Needs ``Resilient(app)``. Every RedBeat setting keeps its meaning; the lock timeout
    defaults to 30 s (not 5 x ``beat_max_loop_interval``) and beat ticks at least every third
    of it, so a standby takes over within one lock timeout and a restart on the same host at
    once.
    """

    def __init__(self, app: Celery, lock_key: str | None = None,
                 lock_timeout: float | None = None, **kwargs: Any) -> None:
        # RedBeat's settings are read first, as RedBeat reads them: reading ours finalizes a
        # pending app.conf, which drops values given by app.conf.add_defaults() (Celery).
        ensure_conf(app)
        self.state = BeatState(Runtime.of(app), liveness.current())
        self.default_policy = CatchupPolicy.from_config(self.resilient.config)
        self._markers, self._statics = self.state.markers, self.state.statics
        self._reconciled_for: object = None
        self._reconciled = False
        self._next_pending = self._next_sync = self._next_prune = 0.0
        self._outages = 0
        self.lock_keeper = LockKeeper(self, self.identity)
        # ``_sender`` is looked up at each send, so one patched on the class still applies.
        sender = lambda entry, producer: self._sender(entry, producer)  # noqa: E731, PLW0108
        self.firing = Firing(app, self.state, sender, self.lock_keeper.keep,
                             self._definition_json)
        self.resender = Resender(self.state, lambda: self.prefix,
                                 lambda key: self.Entry.from_key(key, app=self.app), sender,
                                 self.lock_keeper.keep)
        super().__init__(app, lock_key=lock_key, lock_timeout=lock_timeout, **kwargs)
        if not lock_timeout and not app.redbeat_conf.lock_timeout:
            self.lock_timeout: float = default_timeout(self.max_interval)
        if self.lock_key and not kwargs.get("lazy"):
            self.lock_keeper.await_free()

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def resilient(self) -> Runtime:
        return self.state.runtime

    @property
    def identity(self) -> str:
        return self.state.identity

    @property
    def started_at(self) -> int:
        """Microseconds: when this beat last reconciled (start, lock takeover)."""
        return self.state.started_at

    @started_at.setter
    def started_at(self, value: int) -> None:
        self.state.started_at = value

    @property
    def slots(self) -> ScheduleStore:
        return self.state.slots

    @property
    def prefix(self) -> str:
        prefix: str = self.app.redbeat_conf.key_prefix
        return prefix

    @property
    def holder_key(self) -> str:
        return self.lock_keeper.holder_key

    @property
    def generation_key(self) -> str:
        return f"{self.prefix}:resilient-generation"

    def _redis(self) -> Any:
        return get_redis(self.app)

    @property
    def info(self) -> str:
        p = self.default_policy
        return (f"{super().info}\n       . resilient -> "
                f"{sanitize_url(self.resilient.config.store_url)} catchup={p.mode} "
                f"max_slots={p.max_slots} deadline={p.deadline} grace={p.grace}s")

    def close(self) -> None:
        self.lock_keeper.forget_holder()
        super().close()

    # -- schedule setup ---------------------------------------------------------------------

    def setup_schedule(self) -> None:
        schedule = self.app.conf.beat_schedule or {}
        for name, spec in schedule.items():
            options = spec.get("options") if isinstance(spec, dict) else None
            try:
                self.default_policy.for_options(options, name)
                entries.check_interval(
                    name, spec.get("schedule") if isinstance(spec, dict) else None)
            except ScheduleError as exc:
                raise ConfigurationError(str(exc)) from None
        self._statics.clear()
        self._statics.update(schedule)
        super().setup_schedule()
        self._open_store()

    def _open_store(self) -> None:
        """Open the store (its schema checked, or made on SQLite) as beat starts, not in its
        first tick: a tick decides what is due against the clock, and a first tick that also
        ran the migrations took 100-170 ms of it. A store down now is retried by the ticks."""
        try:
            _ = self.resilient.store
        except StoreUnavailable as exc:
            log.warning("beat: store unavailable at start (%s); the ticks retry it", exc,
                        extra={"action": "store_unavailable"})

    # -- the loop ---------------------------------------------------------------------------

    def tick(self, min: Callable[..., Any] = min, **kwargs: Any) -> float:
        self.lock_keeper.keep_at_tick()  # as RedBeat: a lost lock ends beat
        remaining: list[float] = []
        try:
            token = self.lock_keeper.token()
            if not self._reconciled or token != self._reconciled_for:
                self._reconcile()
                self._reconciled, self._reconciled_for = True, token
            self._maintain()
            for entry in self.schedule.values():
                next_time = self.maybe_due(entry, **self._maybe_due_kwargs)
                if next_time:
                    remaining.append(next_time)
        except RuntimeError:
            log.debug("beat: RuntimeError", exc_info=True)
        except StoreUnavailable as exc:
            self._outages += 1
            cfg = self.resilient.config
            delay = float(min(cfg.store_retry_base * 2 ** (self._outages - 1),
                              cfg.store_retry_max, self.lock_keeper.tick_cap()))
            log.warning("beat: store unavailable (%s); nothing sent, retrying in %.1fs", exc,
                        delay, extra={"action": "store_unavailable"})
            return delay
        self._outages = 0
        return float(min([*remaining, float(self.max_interval), self.lock_keeper.tick_cap()]))

    def maybe_due(self, entry: RedBeatSchedulerEntry, producer: Any = None,
                  **kwargs: Any) -> float | None:
        """Send the entry's due slots (by policy); return seconds until its next slot."""
        key = entry.key
        sched = entry.schedule
        tz = entries.schedule_tz(sched)
        now = to_us(self.app.now())
        policy = self._policy(entry)
        anchor = self._anchor(entry, now)
        sent = 0
        if not entry.enabled:
            last = windows.latest_slot(sched, anchor, now, tz)
            if last is not None:  # a disabled entry's slots pass unsent, not caught up later
                self._markers[key] = from_seconds(self.slots.advance(key, to_seconds(last)))
        else:
            limit = max(policy.max_slots, RECORD_SKIPS)
            window = windows.slots_between(sched, anchor, now, limit, tz)
            if window.total:
                sent = self.firing.fire(entry, policy, window, now=now, producer=producer, tz=tz)
        marker = self._markers[key]
        nxt = windows.next_slot(sched, marker, tz)
        if sent or entry.last_run_at is None or to_us(entry.last_run_at) != marker:
            self._reschedule(entry, marker, nxt, sent, tz)
        if not entry.enabled:
            return 5.0
        if nxt is None:
            return None
        return max((nxt - to_us(self.app.now())) / US, 0.01)

    # -- slots ------------------------------------------------------------------------------

    def _policy(self, entry: RedBeatSchedulerEntry) -> CatchupPolicy:
        try:
            return self.default_policy.for_options(entry.options, entry.name)
        except ScheduleError as exc:
            log.error("beat: %s; using the default policy", exc,
                      extra={"action": "invalid_entry", "entry": entry.name})
            return self.default_policy

    def _anchor(self, entry: RedBeatSchedulerEntry, now: int) -> int:
        """The entry's last slot: the store's marker, else RedBeat's last_run_at, else now."""
        key = entry.key
        if key in self._markers:
            return self._markers[key]
        marker = self.slots.marker(key)
        if marker is None:
            base = entries.first_marker(entry.last_run_at, now)
            self.slots.ensure_markers([(key, to_seconds(base), self._definition_json(entry))])
            created = self.slots.marker(key)
            assert created is not None
            marker = created
        self._markers[key] = from_seconds(marker.last_slot)
        return self._markers[key]

    def _sender(self, entry: RedBeatSchedulerEntry,
                producer: Any) -> Publish:
        """A function publishing one slot of ``entry`` on ``producer`` (the scheduler's one
        producer when None): :func:`.firing.build_sender`. Every first send and re-send gets
        its publisher here."""
        producer = producer if producer is not None else self.producer
        return build_sender(self.app, entry, producer, self.send_task)

    def _reschedule(self, entry: RedBeatSchedulerEntry, marker: int, nxt: int | None,
                    sent: int, tz: tzinfo | None) -> None:
        """RedBeat's meta and score from the marker: ``last_run_at`` is the last slot."""
        entry.last_run_at = from_us(marker, tz)
        client = self._redis()
        if not client.exists(entry.key):
            return  # deleted meanwhile: do not leave a half entry behind
        with client.pipeline() as pipe:
            entries.put_meta(pipe, self.app.redbeat_conf.schedule_key, entry.key,
                             entry.last_run_at, (entry.total_run_count or 0) + sent, nxt)
            pipe.execute()

    def _definition_json(self, entry: RedBeatSchedulerEntry) -> str | None:
        return entries.definition_json(entry, entry.name in self._statics)

    # -- reconcile and maintenance -----------------------------------------------------------

    def _reconcile(self) -> None:
        """Markers against Redis: rehydrate lost entries, fix RedBeat's meta and scores."""
        started = time.monotonic()
        client = self._redis()
        conf = self.app.redbeat_conf
        prefix = self.prefix
        now = to_us(self.app.now())
        self.started_at = now
        markers = self.slots.markers(prefix)
        keys = set(client.zrange(conf.schedule_key, 0, -1))
        hashes = entries.read_hashes(client, sorted(keys | set(markers)))
        rehydrated, removed = self._restore_lost(client, markers, keys, hashes)
        new: list[tuple[str, float, str | None]] = []
        changed: list[tuple[str, str]] = []
        decoded: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        for key, (definition, meta) in hashes.items():
            if not definition:
                continue
            try:
                d = RedBeatSchedulerEntry.decode_definition(definition)
            except ValueError:
                log.error("beat: entry %s has an unreadable definition", key,
                          extra={"action": "invalid_entry", "entry": key})
                continue
            m = RedBeatSchedulerEntry.decode_meta(meta)
            decoded[key] = (d, m)
            wrapped = entries.wrap(definition, d.get("name") in self._statics)
            known = markers.get(key)
            if known is None:
                last = m.get("last_run_at")
                new.append((key, to_seconds(entries.first_marker(last, now)), wrapped))
            elif known.definition_json != wrapped:
                changed.append((key, wrapped))
        self.slots.ensure_markers(new)
        self.slots.set_definitions(changed)
        markers = self.slots.markers(prefix)
        self._markers = {k: from_seconds(m.last_slot) for k, m in markers.items()
                         if k in decoded}
        self._rescore(client, decoded)
        client.set(self.generation_key, uuid.uuid4().hex, nx=True)
        self._next_sync = time.monotonic() + SYNC_EVERY
        self.resender.resend_pending()
        log.info("beat: reconciled %d entries (%d new, %d rehydrated, %d removed) in %.3fs",
                 len(decoded), len(new), rehydrated, removed, time.monotonic() - started,
                 extra={"action": "reconciled", "entries": len(decoded)})

    def _restore_lost(self, client: Any, markers: dict[str, Any], keys: set[str],
                      hashes: dict[str, tuple[str | None, str | None]]) -> tuple[int, int]:
        """Re-create entries lost from Redis; forget those deleted on purpose.

        A dynamic entry missing from Redis was lost if Redis lost its data (our generation
        key is gone too) or only its hash was evicted (still in RedBeat's zset); otherwise it
        was deleted through RedBeat's API. A static entry is gone when the app no longer has it.
        """
        redis_intact = bool(client.exists(self.generation_key))
        rehydrated = removed = 0
        for key, marker in markers.items():
            if hashes.get(key, (None, None))[0]:
                continue
            static, definition = entries.unwrap(marker.definition_json)
            name = key[len(self.prefix):]
            if definition is None or (static and name in self._statics):
                continue
            if static or (redis_intact and key not in keys):
                self.slots.forget(key)
                removed += 1
                log.info("beat: entry %s no longer exists; forgotten", name,
                         extra={"action": "entry_removed", "entry": name})
                continue
            self._rehydrate(name, definition, from_seconds(marker.last_slot))
            hashes[key] = (definition, None)
            rehydrated += 1
        return rehydrated, removed

    def _rescore(self, client: Any, decoded: dict[str, tuple[dict[str, Any],
                                                              dict[str, Any]]]) -> None:
        schedule_key = self.app.redbeat_conf.schedule_key
        with client.pipeline() as pipe:
            for key, (d, m) in decoded.items():
                marker = self._markers.get(key)
                if marker is None:
                    continue
                sched = d.get("schedule")
                if sched is None:
                    continue
                if hasattr(sched, "app"):
                    sched.app = self.app
                tz = entries.schedule_tz(sched)
                nxt = windows.next_slot(sched, marker, tz)
                entries.put_meta(pipe, schedule_key, key, from_us(marker, tz),
                                 m.get("total_run_count") or 0, nxt)
            pipe.execute()

    def _rehydrate(self, name: str, definition: str, marker: int) -> None:
        d = RedBeatSchedulerEntry.decode_definition(definition)
        entry = self.Entry(app=self.app, **d)
        entry.last_run_at = from_us(marker, entries.schedule_tz(entry.schedule))
        entry.save()
        log.warning("beat: entry %s was lost from Redis; restored from the store", name,
                    extra={"action": "entry_rehydrated", "entry": name})

    def _maintain(self) -> None:
        clock = time.monotonic()
        if clock >= self._next_pending:
            self._next_pending = clock + PENDING_EVERY
            self.resender.resend_pending()
        if clock >= self._next_sync:
            self._next_sync = clock + SYNC_EVERY
            self._sync_new_entries()
        retention = self.resilient.config.beat_run_retention
        if clock >= self._next_prune and retention is not None:  # None: kept for ever
            self._next_prune = clock + PRUNE_EVERY
            pruned = self.slots.prune(retention)
            if pruned:
                log.info("beat: pruned %d old slot records", pruned,
                         extra={"action": "pruned", "count": pruned})

    def _sync_new_entries(self) -> None:
        """Give entries added through RedBeat's API a durable definition before they fire."""
        client = self._redis()
        keys = [k for k in client.zrange(self.app.redbeat_conf.schedule_key, 0, -1)
                if k not in self._markers]
        if not keys:
            return
        now = to_us(self.app.now())
        rows: list[tuple[str, float, str | None]] = []
        for key, (definition, meta) in entries.read_hashes(client, keys).items():
            if not definition:
                continue
            last = RedBeatSchedulerEntry.decode_meta(meta).get("last_run_at")
            name = json.loads(definition).get("name")
            rows.append((key, to_seconds(entries.first_marker(last, now)),
                         entries.wrap(definition, name in self._statics)))
        self.slots.ensure_markers(rows)
        for key, m in self.slots.markers(self.prefix).items():
            self._markers.setdefault(key, from_seconds(m.last_slot))


__all__ = ["KILL_AFTER_CLAIM_ENV", "KILL_AFTER_PUBLISH_ENV", "KILL_AFTER_PUBLISH_NTH_ENV",
           "SEND_BATCH", "ResilientScheduler", "task_id_for", "work_key_for"]
