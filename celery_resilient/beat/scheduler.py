"""ResilientScheduler: RedBeat with durable slot records and exactly-once catch-up.

RedBeat keeps deciding *when* to look at an entry (its Redis zset, its lock, its entries and
settings). This class decides *what* to send: every slot between the entry's durable marker
(SQL) and now, by the entry's catch-up policy, each slot claimed in the store before it is
published with a task id and work key derived from (entry, slot). Redis meta ``last_run_at``
is the last slot (not the send time), so RedBeat's due time stays on the schedule's grid.

The class keeps what RedBeat and Celery call (``tick``, ``maybe_due``, ``setup_schedule``,
``close``, ``info``) and composes the parts that do the work, one job each:

- :mod:`.lock`: RedBeat's lock (a dead holder's taken over at once, renewals, tick cap);
- :mod:`.firing`: an entry's due slots: claim, publish, record sent, in batches;
- :mod:`.resend`: slots claimed but never recorded sent, of dead or stale claimers;
- :mod:`.reconcile`: Redis's schedule against the store's markers (rehydrate, forget,
  rescore, sync entries added through RedBeat's API);
- :mod:`.maintenance`: the chores on timers (re-sends, syncs, pruning);
- :mod:`.state`: what the parts share; :mod:`.entries`: RedBeat's entry records;
  :mod:`.slot_ids`: a slot's task id and work key; :mod:`.killpoints`: test-only kills.

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

import time
from collections.abc import Callable
from typing import Any

from celery import Celery
from redbeat.schedulers import RedBeatScheduler, RedBeatSchedulerEntry, ensure_conf

from celery_resilient.beat import entries
from celery_resilient.beat.firing import SEND_BATCH, Firing, Publish, build_sender
from celery_resilient.beat.killpoints import (
    KILL_AFTER_CLAIM_ENV,
    KILL_AFTER_PUBLISH_ENV,
    KILL_AFTER_PUBLISH_NTH_ENV,
)
from celery_resilient.beat.lock import LockKeeper, default_timeout
from celery_resilient.beat.log import log
from celery_resilient.beat.maintenance import Maintenance
from celery_resilient.beat.policy import CatchupPolicy
from celery_resilient.beat.reconcile import Reconciler
from celery_resilient.beat.resend import Resender
from celery_resilient.beat.slot_ids import task_id_for, work_key_for
from celery_resilient.beat.state import BeatState
from celery_resilient.beat.windows import to_us
from celery_resilient.core import liveness
from celery_resilient.errors import ConfigurationError, ScheduleError, StoreUnavailable
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.schedule import ScheduleStore


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
        self.resilient, self.identity = self.state.runtime, self.state.identity
        self.default_policy = CatchupPolicy.from_config(self.resilient.config)
        self._reconciled_for: object = None
        self._reconciled = False
        self._outages = 0
        self._compose(app)
        super().__init__(app, lock_key=lock_key, lock_timeout=lock_timeout, **kwargs)
        if not lock_timeout and not app.redbeat_conf.lock_timeout:
            self.lock_timeout: float = default_timeout(self.max_interval)
        if self.lock_key and not kwargs.get("lazy"):
            self.lock_keeper.await_free()

    def _compose(self, app: Celery) -> None:
        """The parts, before RedBeat's ``__init__`` (which runs ``setup_schedule``)."""
        self.lock_keeper = LockKeeper(self, self.identity)
        keep = self.lock_keeper.keep
        # ``_sender`` is looked up at each send, so one patched on the class still applies.
        sender = lambda entry, producer: self._sender(entry, producer)  # noqa: E731, PLW0108
        self.firing = Firing(app, self.state, sender, keep, self._policy)
        self.resender = Resender(app, self.state, self.Entry, sender, keep)
        self.reconciler = Reconciler(app, self.state, self.Entry)
        self.maintenance = Maintenance(self.state, self.resender.resend_pending,
                                       self.reconciler.sync_new_entries)

    # -- what the parts share, for callers of the scheduler ---------------------------------

    @property
    def started_at(self) -> int:
        """Microseconds: when this beat last reconciled (start, lock takeover)."""
        return self.state.started_at

    @started_at.setter
    def started_at(self, value: int) -> None:
        self.state.started_at = value

    @property
    def slots(self) -> ScheduleStore:
        """The store's slot records and markers."""
        return self.state.slots

    @property
    def prefix(self) -> str:
        """RedBeat's key prefix (``redbeat_key_prefix``): whose entries this beat fires and
        whose markers and slot records it reads."""
        return self.reconciler.prefix

    @property
    def holder_key(self) -> str:
        """Where this beat records that it holds RedBeat's lock (:mod:`.lock`)."""
        return self.lock_keeper.holder_key

    @property
    def generation_key(self) -> str:
        """The Redis key whose absence says Redis lost its data (:mod:`.reconcile`)."""
        return self.reconciler.generation_key

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
        self.state.statics.clear()  # in place: every part holds this set
        self.state.statics.update(schedule)
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
            self.maintenance.run()
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
        return self.firing.maybe_due(entry, producer)

    def _policy(self, entry: RedBeatSchedulerEntry) -> CatchupPolicy:
        try:
            return self.default_policy.for_options(entry.options, entry.name)
        except ScheduleError as exc:
            log.error("beat: %s; using the default policy", exc,
                      extra={"action": "invalid_entry", "entry": entry.name})
            return self.default_policy

    def _sender(self, entry: RedBeatSchedulerEntry, producer: Any) -> Publish:
        """A function publishing one slot of ``entry`` on ``producer`` (the scheduler's one
        producer when None): :func:`.firing.build_sender`. Every first send and re-send gets
        its publisher here."""
        producer = producer if producer is not None else self.producer
        return build_sender(self.app, entry, producer, self.send_task)

    def _reconcile(self) -> None:
        """On start and after a lock takeover: Redis against the store, then the re-sends."""
        started = time.monotonic()
        self.started_at = to_us(self.app.now())
        done = self.reconciler.reconcile(self.started_at)
        self.maintenance.syncing.postpone()  # the reconcile synced every entry
        self.resender.resend_pending()
        log.info("beat: reconciled %d entries (%d new, %d rehydrated, %d removed) in %.3fs",
                 done.entries, done.new, done.rehydrated, done.removed,
                 time.monotonic() - started,
                 extra={"action": "reconciled", "entries": done.entries})


__all__ = ["KILL_AFTER_CLAIM_ENV", "KILL_AFTER_PUBLISH_ENV", "KILL_AFTER_PUBLISH_NTH_ENV",
           "SEND_BATCH", "ResilientScheduler", "task_id_for", "work_key_for"]
