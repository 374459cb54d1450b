"""Firing an entry's due slots: claim them, publish them, record them sent, in batches.

RedBeat decides when to look at an entry (``maybe_due``); :meth:`Firing.maybe_due` decides
what to send: every slot between the entry's marker in the store and now, by the entry's
catch-up policy (:mod:`.policy`, the slots from :mod:`.windows`). Afterwards RedBeat's meta
and score follow the marker: ``last_run_at`` is the last slot, not the send time, so RedBeat's
due time stays on the schedule's grid.

The order is what makes a slot start once: every slot of a window is claimed in the store
(one transaction that also moves the entry's marker) before any is published, and recorded
sent only after its publish. A beat killed between the two leaves the slot ``claimed``; the
next beat re-sends it with the same task id (:mod:`.resend`). A slot another beat already
claimed or sent is refused (``duplicate_refused``), unless its claimer is provably dead.

Every slot goes out on one producer (one broker connection) through the task's own
``apply_async``, with the slot headers; the sends are recorded :data:`SEND_BATCH` at a time
(:class:`SentBatch`, shared with the re-sends), the lock extended between batches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import tzinfo
from typing import Any

from celery import Celery
from celery.beat import _evaluate_entry_args, _evaluate_entry_kwargs
from redbeat.schedulers import RedBeatSchedulerEntry, get_redis

from celery_resilient import signals
from celery_resilient.beat import entries, killpoints, windows
from celery_resilient.beat.log import log
from celery_resilient.beat.once import ENTRY_HEADER
from celery_resilient.beat.policy import CatchupPolicy, Decision, decide, strip_options
from celery_resilient.beat.slot_ids import task_id_for, work_key_for
from celery_resilient.beat.state import BeatState
from celery_resilient.beat.windows import US, from_seconds, from_us, to_seconds, to_us
from celery_resilient.core import liveness, workkey
from celery_resilient.core.states import CLAIMED
from celery_resilient.errors import StoreUnavailable
from celery_resilient.store.schedule import ClaimResult, ScheduleStore
from celery_resilient.tasks.task import SCHEDULED_FOR_HEADER

SEND_BATCH = 500  # slots published between two records of their sends (one transaction)
RECORD_SKIPS = 1000  # at least this many of a window's latest slots are recorded when skipped

#: Publishes one slot: ``(slot, task_id, scheduled_for)``.
Publish = Callable[[int, str, str], None]
#: Makes the :data:`Publish` of an entry, on a producer (None: the scheduler's own).
SenderFactory = Callable[[RedBeatSchedulerEntry, Any], Publish]


def stamp(slot: int, tz: tzinfo | None) -> str:
    """A slot as the ISO time it carries in headers and logs (in the entry's timezone)."""
    return from_us(slot, tz).isoformat()


def build_sender(app: Celery, entry: RedBeatSchedulerEntry, producer: Any,
                 send_task: Callable[..., Any]) -> Publish:
    """A function publishing one slot of ``entry`` (options resolved once per entry).

    Every slot goes through ``task.apply_async`` (or ``send_task`` for a task this process
    does not know), as Celery's own beat sends, on ``producer``: Celery's publish signals and
    routing keep working.
    """
    options = strip_options(entry.options or {})
    options.pop("task_id", None)
    base_headers = dict(options.pop("headers", None) or {})
    base_headers["celery_beat_task"] = True
    task = app.tasks.get(entry.task)
    key = entry.key
    publish = task.apply_async if task is not None else functools.partial(send_task, entry.task)

    def send(slot: int, task_id: str, scheduled_for: str) -> None:
        headers = {**base_headers, SCHEDULED_FOR_HEADER: scheduled_for,
                   ENTRY_HEADER: key, workkey.HEADER: work_key_for(key, slot)}
        publish(_evaluate_entry_args(entry.args), _evaluate_entry_kwargs(entry.kwargs),
                producer=producer, task_id=task_id, headers=headers, **options)

    return send


class SentBatch:
    """Publishes one entry's claimed slots in order and records them sent in batches.

    One ``mark_sent`` transaction per :data:`SEND_BATCH` published slots, the lock extended
    after each; :meth:`flush` records the rest. A failed publish leaves the slots after it
    claimed (re-sent later); what was published before it is still recorded by :meth:`flush`.
    """

    def __init__(self, slots: ScheduleStore, key: str, owner: str, publish: Publish,
                 tz: tzinfo | None, keep_lock: Callable[[], None]) -> None:
        self.slots, self.key, self.owner = slots, key, owner
        self.publish, self.tz, self.keep_lock = publish, tz, keep_lock
        self.done: list[float] = []
        self.total = 0

    def send(self, slots: Iterable[tuple[int, str]],
             then: Callable[[int, str, str], None]) -> Exception | None:
        """Publish each ``(slot, task_id)``, ``then(slot, task_id, stamp)`` after each.

        Stops at the first error and returns it (broker trouble: the slots not published
        stay claimed and are re-sent later), except a store outage, which raises.
        """
        try:
            for slot, task_id in slots:
                at = stamp(slot, self.tz)
                self.publish(slot, task_id, at)
                killpoints.after_publish()
                self.done.append(to_seconds(slot))
                then(slot, task_id, at)
                if len(self.done) >= SEND_BATCH:
                    self.total += self.slots.mark_sent(self.key, self.done, self.owner)
                    self.done = []
                    self.keep_lock()
        except StoreUnavailable:
            raise
        except Exception as exc:
            return exc
        return None

    def flush(self) -> int:
        """Record what is published and not yet recorded; the slots recorded sent in all."""
        if self.done:
            self.total += self.slots.mark_sent(self.key, self.done, self.owner)
            self.done = []
        return self.total


class CaughtUp:
    """The late slots of one send of an entry: each signalled (``slot_caught_up``) and
    logged at DEBUG as it is published, then one INFO line for them all (:meth:`log`).

    Late: before this beat's last reconcile (missed while no beat ran), or sent more than
    the policy's grace after its time.
    """

    def __init__(self, app: Celery, name: str, now: int, grace: int, started: int) -> None:
        self.app, self.name, self.now, self.grace, self.started = app, name, now, grace, started
        self.debug = log.isEnabledFor(logging.DEBUG)
        self.late: list[tuple[int, str]] = []  # (slot, stamp), oldest first

    def __call__(self, slot: int, task_id: str, at: str) -> None:
        """``slot`` was published as ``task_id`` (``at``: its stamp)."""
        now, name, signal = self.now, self.name, signals.slot_caught_up
        if not (slot < self.started or now - slot > self.grace):
            return
        self.late.append((slot, at))
        if self.debug:
            log.debug("beat: %s slot %s caught up (%.1fs late)", name, at, (now - slot) / US,
                      extra={"action": "slot_caught_up", "entry": name, "slot": at})
        if signal.receivers:
            signals.send(signal, self.app, name, entry=name, slot=at, task_id=task_id,
                         late_seconds=(now - slot) / US)

    def log(self) -> None:
        """One line for the late slots of this send, if any."""
        if not self.late:
            return
        name, now = self.name, self.now
        (first, first_stamp), (last, last_stamp) = self.late[0], self.late[-1]
        if len(self.late) == 1:
            log.info("beat: %s: 1 missed slot caught up: %s (%.1fs late)", name, first_stamp,
                     (now - first) / US, extra={"action": "slot_caught_up", "entry": name,
                                                "count": 1, "first": first_stamp,
                                                "last": first_stamp})
            return
        log.info("beat: %s: %d missed slots caught up: %s to %s (%.1fs to %.1fs late)", name,
                 len(self.late), first_stamp, last_stamp, (now - first) / US,
                 (now - last) / US, extra={"action": "slot_caught_up", "entry": name,
                                           "count": len(self.late), "first": first_stamp,
                                           "last": last_stamp})


class Firing:
    """Claims the due slots of an entry and sends them (by the entry's catch-up policy)."""

    def __init__(self, app: Celery, state: BeatState, sender: SenderFactory,
                 keep_lock: Callable[[], None],
                 policy_of: Callable[[RedBeatSchedulerEntry], CatchupPolicy]) -> None:
        self.app, self.state, self.sender = app, state, sender
        self.keep_lock, self.policy_of = keep_lock, policy_of

    def maybe_due(self, entry: RedBeatSchedulerEntry, producer: Any) -> float | None:
        """Send the entry's due slots (by policy); return seconds until its next slot."""
        key = entry.key
        sched = entry.schedule
        tz = entries.schedule_tz(sched)
        now = to_us(self.app.now())
        policy = self.policy_of(entry)
        anchor = self._anchor(entry, now)
        markers = self.state.markers
        sent = 0
        if not entry.enabled:
            last = windows.latest_slot(sched, anchor, now, tz)
            if last is not None:  # a disabled entry's slots pass unsent, not caught up later
                markers[key] = from_seconds(self.state.slots.advance(key, to_seconds(last)))
        else:
            limit = max(policy.max_slots, RECORD_SKIPS)
            window = windows.slots_between(sched, anchor, now, limit, tz)
            if window.total:
                sent = self._fire(entry, policy, window, now=now, producer=producer, tz=tz)
        marker = markers[key]
        nxt = windows.next_slot(sched, marker, tz)
        if sent or entry.last_run_at is None or to_us(entry.last_run_at) != marker:
            self._reschedule(entry, marker, nxt, sent, tz)
        if not entry.enabled:
            return 5.0
        if nxt is None:
            return None
        return max((nxt - to_us(self.app.now())) / US, 0.01)

    def _anchor(self, entry: RedBeatSchedulerEntry, now: int) -> int:
        """The entry's last slot: the store's marker, else RedBeat's last_run_at, else now."""
        key = entry.key
        markers, slots = self.state.markers, self.state.slots
        if key in markers:
            return markers[key]
        marker = slots.marker(key)
        if marker is None:
            base = entries.first_marker(entry.last_run_at, now)
            slots.ensure_markers([(key, to_seconds(base), self._definition_json(entry))])
            created = slots.marker(key)
            assert created is not None
            marker = created
        markers[key] = from_seconds(marker.last_slot)
        return markers[key]

    def _reschedule(self, entry: RedBeatSchedulerEntry, marker: int, nxt: int | None,
                    sent: int, tz: tzinfo | None) -> None:
        """RedBeat's meta and score from the marker: ``last_run_at`` is the last slot."""
        entry.last_run_at = from_us(marker, tz)
        client = get_redis(self.app)
        if not client.exists(entry.key):
            return  # deleted meanwhile: do not leave a half entry behind
        with client.pipeline() as pipe:
            entries.put_meta(pipe, self.app.redbeat_conf.schedule_key, entry.key,
                             entry.last_run_at, (entry.total_run_count or 0) + sent, nxt)
            pipe.execute()

    def _definition_json(self, entry: RedBeatSchedulerEntry) -> str | None:
        """The stored form of ``entry``'s definition (static or dynamic)."""
        return entries.definition_json(entry, entry.name in self.state.statics)

    def _fire(self, entry: RedBeatSchedulerEntry, policy: CatchupPolicy,
             window: windows.Missed, *, now: int, producer: Any, tz: tzinfo | None) -> int:
        """Claim the window's slots (skipped ones recorded), send those claimed; the number
        recorded sent."""
        key = entry.key
        state = self.state
        decision = decide(policy, window.slots, window.total, now, state.started_at)
        ids = {s: task_id_for(key, s) for s in decision.send}
        result = state.slots.claim(
            key, state.identity, [(to_seconds(s), ids[s]) for s in decision.send],
            [(to_seconds(s), task_id_for(key, s)) for s, _ in decision.skipped],
            marker=to_seconds(window.slots[-1]), definition_json=self._definition_json(entry),
        )
        state.markers[key] = from_seconds(result.marker)
        killpoints.after_claim()
        _log_skips(entry.name, decision, policy, tz)
        claimed = {from_seconds(s) for s in result.claimed}
        to_send = [s for s in decision.send if s in claimed]
        to_send.extend(self._take_or_refuse(entry, result, ids, tz))
        to_send.sort()
        return self._send(entry, [(s, ids[s]) for s in to_send], now=now, policy=policy,
                         producer=producer, tz=tz)

    def _take_or_refuse(self, entry: RedBeatSchedulerEntry, result: ClaimResult,
                        ids: dict[int, str], tz: tzinfo | None) -> list[int]:
        """Slots that already had a row: take over those claimed by this beat or a dead one
        (returned, to send), refuse the rest (``duplicate_refused``)."""
        identity, name = self.state.identity, entry.name
        ours = [row for row in result.existing if row.state == CLAIMED and (
            row.owner == identity or liveness.is_dead(row.owner))]
        taken = {from_seconds(s) for s in self.state.slots.take_over_many(
            entry.key, [(row.slot, row.owner) for row in ours], identity)} if ours else set()
        to_send: list[int] = []
        for row in result.existing:
            slot = from_seconds(row.slot)
            if slot in taken:
                to_send.append(slot)
                ids.setdefault(slot, row.task_id)
                continue
            log.info("beat: %s slot %s already %s by %s; not sent again", name,
                     stamp(slot, tz), row.state, row.owner,
                     extra={"action": "duplicate_refused", "entry": name,
                            "slot": stamp(slot, tz), "state": row.state})
        return to_send

    def _send(self, entry: RedBeatSchedulerEntry, slots: Sequence[tuple[int, str]], *,
             now: int, policy: CatchupPolicy, producer: Any, tz: tzinfo | None) -> int:
        """Publish claimed ``(slot, task_id)`` in order, recording them sent in batches.

        One producer (one broker connection) for the whole catch-up. Late slots get one
        ``slot_caught_up`` log line per call (per slot at DEBUG) and one ``slot_caught_up``
        signal each.
        """
        name = entry.name
        caught_up = CaughtUp(self.app, name, now, round(policy.grace * US),
                             self.state.started_at)
        batch = SentBatch(self.state.slots, entry.key, self.state.identity,
                          self.sender(entry, producer), tz, self.keep_lock)
        try:
            error = batch.send(slots, caught_up)
            if error is not None:  # broker trouble: the claimed rows are re-sent later
                log.error("beat: sending %s failed: %s; its claimed slots are re-sent later",
                          name, error, extra={"action": "publish_failed", "entry": name})
        finally:
            caught_up.log()
        return batch.flush()


def _log_skips(name: str, decision: Decision, policy: CatchupPolicy,
               tz: tzinfo | None) -> None:
    if decision.dropped:
        log.warning("beat: %s: %d missed slots older than the latest %d skipped (cap)",
                    name, decision.dropped, policy.max_slots,
                    extra={"action": "slots_dropped", "entry": name,
                           "count": decision.dropped})
    for slot, why in decision.skipped:
        log.info("beat: %s slot %s skipped (%s, policy %s)", name, stamp(slot, tz), why,
                 policy.mode, extra={"action": "slot_skipped", "entry": name,
                                     "slot": stamp(slot, tz), "reason": why})


__all__ = ["RECORD_SKIPS", "SEND_BATCH", "CaughtUp", "Firing", "Publish", "SenderFactory",
           "SentBatch", "build_sender", "stamp"]
