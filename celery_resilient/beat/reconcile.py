"""Reconcile RedBeat's schedule in Redis with the store's markers, the durable side.

Redis can lose entries (a restart without persistence, a flush, an eviction) and RedBeat's
meta says when an entry was last *sent*, not which slot; the store knows each entry's last
slot and definition. So on start and after every lock takeover the beat:

- rehydrates the entries lost from Redis from their stored definitions, and forgets those
  deleted on purpose (through RedBeat's API, or gone from ``beat_schedule``);
- gives every entry a marker (new entries start from RedBeat's ``last_run_at``) and records
  changed definitions;
- rescores: RedBeat's ``last_run_at`` and score are set from the marker, so its due time is
  the next slot on the schedule's grid;
- leaves a generation key in Redis, whose absence later says Redis lost its data.

Between reconciles, :meth:`Reconciler.sync_new_entries` gives entries added through
RedBeat's API a marker and a stored definition before they fire.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery
from redbeat.schedulers import RedBeatSchedulerEntry, get_redis

from celery_resilient.beat import entries, windows
from celery_resilient.beat.log import log
from celery_resilient.beat.state import BeatState
from celery_resilient.beat.windows import from_seconds, from_us, to_seconds, to_us
from celery_resilient.store.schedule import Marker

#: RedBeat's decoded definition and meta of each readable entry, by key.
Decoded = dict[str, tuple[dict[str, Any], dict[str, Any]]]
#: New markers to create: ``(entry key, last slot in seconds, stored definition)``.
NewMarkers = list[tuple[str, float, str | None]]


@dataclass(frozen=True)
class Reconciled:
    """What a reconcile found: readable entries, and how many were new, rehydrated, removed."""

    entries: int
    new: int
    rehydrated: int
    removed: int


class Reconciler:
    """Brings Redis and the store's markers of this beat's key prefix into agreement."""

    def __init__(self, app: Celery, state: BeatState,
                 entry_class: type[RedBeatSchedulerEntry]) -> None:
        self.app, self.state, self.entry_class = app, state, entry_class

    @property
    def prefix(self) -> str:
        return entries.key_prefix(self.app)

    @property
    def generation_key(self) -> str:
        return f"{self.prefix}:resilient-generation"

    def reconcile(self, now: int) -> Reconciled:
        """Markers against Redis: rehydrate lost entries, fix RedBeat's meta and scores."""
        client = get_redis(self.app)
        slots = self.state.slots
        markers = slots.markers(self.prefix)
        keys = set(client.zrange(self.app.redbeat_conf.schedule_key, 0, -1))
        hashes = entries.read_hashes(client, sorted(keys | set(markers)))
        rehydrated, removed = self._restore_lost(client, markers, keys, hashes)
        decoded, new, changed = self._compare(hashes, markers, now)
        slots.ensure_markers(new)
        slots.set_definitions(changed)
        fresh = {k: from_seconds(m.last_slot) for k, m in slots.markers(self.prefix).items()
                 if k in decoded}
        self.state.markers.clear()  # replaced in place: every part holds this dict
        self.state.markers.update(fresh)
        self._rescore(client, decoded)
        client.set(self.generation_key, uuid.uuid4().hex, nx=True)
        return Reconciled(len(decoded), len(new), rehydrated, removed)

    def _compare(self, hashes: dict[str, entries.Hash], markers: dict[str, Marker],
                 now: int) -> tuple[Decoded, NewMarkers, list[tuple[str, str]]]:
        """Each readable entry against its marker: ``(decoded, new markers, changed
        definitions)``."""
        new: NewMarkers = []
        changed: list[tuple[str, str]] = []
        decoded: Decoded = {}
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
            wrapped = entries.wrap(definition, d.get("name") in self.state.statics)
            known = markers.get(key)
            if known is None:
                last = m.get("last_run_at")
                new.append((key, to_seconds(entries.first_marker(last, now)), wrapped))
            elif known.definition_json != wrapped:
                changed.append((key, wrapped))
        return decoded, new, changed

    def _restore_lost(self, client: Any, markers: dict[str, Marker], keys: set[str],
                      hashes: dict[str, entries.Hash]) -> tuple[int, int]:
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
            if definition is None or (static and name in self.state.statics):
                continue
            if static or (redis_intact and key not in keys):
                self.state.slots.forget(key)
                removed += 1
                log.info("beat: entry %s no longer exists; forgotten", name,
                         extra={"action": "entry_removed", "entry": name})
                continue
            self._rehydrate(name, definition, from_seconds(marker.last_slot))
            hashes[key] = (definition, None)
            rehydrated += 1
        return rehydrated, removed

    def _rescore(self, client: Any, decoded: Decoded) -> None:
        """RedBeat's meta and score of every entry with a marker, from the marker."""
        schedule_key = self.app.redbeat_conf.schedule_key
        with client.pipeline() as pipe:
            for key, (d, m) in decoded.items():
                marker = self.state.markers.get(key)
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
        entry = self.entry_class(app=self.app, **d)
        entry.last_run_at = from_us(marker, entries.schedule_tz(entry.schedule))
        entry.save()
        log.warning("beat: entry %s was lost from Redis; restored from the store", name,
                    extra={"action": "entry_rehydrated", "entry": name})

    def sync_new_entries(self) -> None:
        """Give entries added through RedBeat's API a durable definition before they fire."""
        client = get_redis(self.app)
        markers = self.state.markers
        keys = [k for k in client.zrange(self.app.redbeat_conf.schedule_key, 0, -1)
                if k not in markers]
        if not keys:
            return
        now = to_us(self.app.now())
        rows: NewMarkers = []
        for key, (definition, meta) in entries.read_hashes(client, keys).items():
            if not definition:
                continue
            last = RedBeatSchedulerEntry.decode_meta(meta).get("last_run_at")
            name = json.loads(definition).get("name")
            rows.append((key, to_seconds(entries.first_marker(last, now)),
                         entries.wrap(definition, name in self.state.statics)))
        self.state.slots.ensure_markers(rows)
        for key, m in self.state.slots.markers(self.prefix).items():
            markers.setdefault(key, from_seconds(m.last_slot))


__all__ = ["Reconciled", "Reconciler"]
