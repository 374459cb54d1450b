"""The chores a beat's tick runs on timers, besides firing: re-sends, syncs, pruning.

Each tick, before it looks at the due entries, the beat re-sends claimed-but-unsent slots
every :data:`PENDING_EVERY` seconds (:mod:`.resend`), gives entries added through RedBeat's
API a stored definition every :data:`SYNC_EVERY` seconds (:mod:`.reconcile`), and prunes old
slot records hourly (``resilient_beat_run_retention``; None keeps them for ever). Each chore
runs at the first tick (its timer starts due) and then on its own clock (monotonic).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from celery_resilient.beat.log import log
from celery_resilient.beat.state import BeatState

PENDING_EVERY = 5.0  # look for claimed-but-unsent slots this often
SYNC_EVERY = 30.0  # record definitions of entries added through RedBeat's API
PRUNE_EVERY = 3600.0


class Every:
    """A chore's timer on the monotonic clock: due at first, then every ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.next = 0.0

    def due(self, clock: float) -> bool:
        """True (and the next time set) if the chore is due at ``clock``."""
        if clock < self.next:
            return False
        self.next = clock + self.seconds
        return True

    def postpone(self) -> None:
        """The chore was just done some other way: due again ``seconds`` from now."""
        self.next = time.monotonic() + self.seconds


class Maintenance:
    """Runs the timed chores of one beat."""

    def __init__(self, state: BeatState, resend: Callable[[], None],
                 sync: Callable[[], None]) -> None:
        self.state, self.resend, self.sync = state, resend, sync
        self.pending = Every(PENDING_EVERY)
        self.syncing = Every(SYNC_EVERY)
        self.pruning = Every(PRUNE_EVERY)

    def run(self) -> None:
        """Run the chores that are due (a store outage raises ``StoreUnavailable``)."""
        clock = time.monotonic()
        if self.pending.due(clock):
            self.resend()
        if self.syncing.due(clock):
            self.sync()
        retention = self.state.runtime.config.beat_run_retention
        if retention is not None and self.pruning.due(clock):  # None: kept for ever
            pruned = self.state.slots.prune(retention)
            if pruned:
                log.info("beat: pruned %d old slot records", pruned,
                         extra={"action": "pruned", "count": pruned})


__all__ = ["PENDING_EVERY", "PRUNE_EVERY", "SYNC_EVERY", "Every", "Maintenance"]
