"""Re-sends of slots claimed but never recorded sent: a beat died between claim and record.

A slot is claimed before it is published and recorded sent after (:mod:`.firing`), so a beat
killed in between, a publish that failed or a store error at the record leaves the slot
``claimed``. Whichever beat looks next (at reconcile, then every few seconds) sends it again
with its own task id, if its claimer is this beat, is provably dead, or claimed it more than
:data:`STALE_CLAIM_SECONDS` ago (a claimer that may live but has not recorded the send by
then is taken over: a copy of the message costs nothing, each slot still starts once). Taking
a row over is a compare-and-set, so of two beats only one re-sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from celery import Celery
from redbeat.schedulers import RedBeatSchedulerEntry

from celery_resilient.beat import entries
from celery_resilient.beat.firing import SenderFactory, SentBatch
from celery_resilient.beat.log import log
from celery_resilient.beat.state import BeatState
from celery_resilient.beat.windows import from_seconds
from celery_resilient.core import liveness
from celery_resilient.store.schedule import Run

STALE_CLAIM_SECONDS = 60.0  # a claim older than this is re-sent even if its owner may live
PENDING_PAGE = 1000  # claimed-but-unsent rows read at a time
PENDING_PAGES = 100  # at most this many pages per look (100,000 slots)


class Resender:
    """Finds the claimed-but-unsent slots this beat may send, and sends them again."""

    def __init__(self, app: Celery, state: BeatState,
                 entry_class: type[RedBeatSchedulerEntry], sender: SenderFactory,
                 keep_lock: Callable[[], None]) -> None:
        self.app, self.state, self.entry_class = app, state, entry_class
        self.sender, self.keep_lock = sender, keep_lock

    def resend_pending(self) -> None:
        """Send slots that were claimed but never recorded sent (a beat died in between).

        Batched as the catch-up is: per entry, one compare-and-set transaction takes the
        rows of dead (or stale) owners, each slot is published on the one producer with its
        own task id, and the sends are recorded in batches. Pages of :data:`PENDING_PAGE`
        rows until none is left that this beat may send.
        """
        db_now: float | None = None
        gone: dict[str | None, bool] = {}
        for _ in range(PENDING_PAGES):
            rows = self.state.slots.pending(entries.key_prefix(self.app), limit=PENDING_PAGE)
            if not rows:
                return
            if db_now is None:
                db_now = self.state.runtime.store.now()
            sent = 0
            for key, runs in self._ours(rows, db_now, gone).items():
                count, ok = self._resend_entry(key, runs)
                sent += count
                if not ok:
                    return
            if len(rows) < PENDING_PAGE or not sent:
                return

    def _ours(self, rows: Sequence[Run], db_now: float,
              gone: dict[str | None, bool]) -> dict[str, list[Run]]:
        """The rows this beat may re-send, by entry: its own, a dead owner's, stale ones."""
        identity = self.state.identity
        by_entry: dict[str, list[Run]] = {}
        for row in rows:
            if row.owner not in gone:  # one liveness check per owner, not per row
                gone[row.owner] = row.owner == identity or liveness.is_dead(row.owner)
            if gone[row.owner] or db_now - row.claimed_at > STALE_CLAIM_SECONDS:
                by_entry.setdefault(row.entry, []).append(row)
        return by_entry

    def _resend_entry(self, key: str, rows: Sequence[Run]) -> tuple[int, bool]:
        """Re-send one entry's claimed rows; ``(slots recorded sent, no publish failed)``."""
        try:
            entry = self.entry_class.from_key(key, app=self.app)
        except KeyError:
            log.error("beat: %d claimed slots of %s cannot be re-sent: the entry is gone",
                      len(rows), key, extra={"action": "unrecoverable", "entry": key})
            return 0, True
        owners = {from_seconds(row.slot): row.owner for row in rows}
        slots = self._take(key, rows)
        ids = {row.slot: row.task_id for row in rows}

        def resent(slot: int, task_id: str, at: str) -> None:
            log.warning("beat: %s slot %s was claimed by %s but not recorded sent; "
                        "re-sent as %s", entry.name, at, owners[slot], task_id,
                        extra={"action": "slot_resent", "entry": entry.name,
                               "slot": at, "task_id": task_id})

        batch = SentBatch(self.state.slots, key, self.state.identity,
                          self.sender(entry, None), entries.schedule_tz(entry.schedule),
                          self.keep_lock)
        error = batch.send([(from_seconds(s), ids[s]) for s in sorted(slots)], resent)
        if error is not None:
            log.error("beat: re-sending %s failed: %s; its claimed slots are re-sent later",
                      entry.name, error, extra={"action": "publish_failed",
                                                "entry": entry.name})
        return batch.flush(), error is None

    def _take(self, key: str, rows: Sequence[Run]) -> list[float]:
        """The slots of ``rows`` this beat may send now: its own claims, and those it took
        over (one compare-and-set transaction: of two beats, one wins each row)."""
        identity = self.state.identity
        slots = [row.slot for row in rows if row.owner == identity]
        others = [(row.slot, row.owner) for row in rows if row.owner != identity]
        if others:
            slots.extend(self.state.slots.take_over_many(key, others, identity))
        return slots


__all__ = ["PENDING_PAGE", "PENDING_PAGES", "STALE_CLAIM_SECONDS", "Resender"]
