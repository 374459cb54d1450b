"""What the parts of one beat share: who it is, its slot records, and what it knows of them.

The scheduler owns one :class:`BeatState` and hands it to each of its parts (firing,
re-sends, reconcile, maintenance); none of them keeps a copy of these values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.schedule import ScheduleStore


@dataclass(eq=False)
class BeatState:
    """The shared state of one beat process."""

    #: The app's settings and store (``Runtime.of(app)``).
    runtime: Runtime
    #: This beat's liveness identity: the owner of the slots it claims.
    identity: str
    #: The store's marker (last slot, microseconds) of each entry this beat fires, as it last
    #: read or moved it. Mutated in place, never replaced: every part holds this one dict.
    markers: dict[str, int] = field(default_factory=dict)
    #: Names of the static entries (``beat_schedule``). Mutated in place, never replaced.
    statics: set[str] = field(default_factory=set)
    #: Microseconds: when this beat last reconciled (start, lock takeover). A slot before it
    #: was missed while no beat ran, so it is caught up whatever the grace.
    started_at: int = 0
    _slots: ScheduleStore | None = None

    @property
    def slots(self) -> ScheduleStore:
        """The store's slot records (made at first use, so a store down at start is no error)."""
        if self._slots is None:
            self._slots = self.runtime.store.schedule
        return self._slots


__all__ = ["BeatState"]
