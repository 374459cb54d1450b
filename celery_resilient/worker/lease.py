"""``LeaseKeeper``: renews this worker incarnation's one lease row, on a connection of its own.

It runs from worker start until the pool has drained at shutdown, never behind a sweep, a
re-publish, a receipt flush or a user's transaction: claims are live while their
incarnation's lease is, so nothing may stand between a lease and its renewal.
"""

from __future__ import annotations

import logging
import threading
import time

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import deadlines
from celery_resilient.store.sql import Store
from celery_resilient.tasks import handed_claims

log = logging.getLogger(__name__)


def backoff(rt: Runtime, failures: int, cap: float) -> float:
    return float(min(rt.config.store_retry_base * 2 ** min(failures, 10), cap))

class LeaseKeeper(threading.Thread):
    """Renews this incarnation's lease row until stopped, on its own store connection."""

    def __init__(self, rt: Runtime, owner: Owner) -> None:
        super().__init__(name="celery-resilient-lease", daemon=True)
        self.rt = rt
        self.owner = owner
        cfg = rt.config
        self.store = Store(cfg.store_url, cfg.table_prefix)  # a pool of its own
        self._stop_event = threading.Event()
        #: Monotonic time of the last failed renewal (None: none yet).
        self.last_failure: float | None = None
        self.renewals = 0
        self._declared_dead_logged = False
        #: Monotonic time the last successful renewal was sent (the worker registered its
        #: first lease just before this keeper was made): its expiry on the store's clock
        #: is at least ``lease_seconds`` after this.
        self.renewal_sent_at = time.monotonic()
        handed_claims.lease_good_until(self.renewal_sent_at + cfg.fence_after)
        #: Another worker proved this incarnation dead (a renewal found it stopped).
        self.declared_dead = False
        #: Seconds between two renewals when the later one came past ``fence_after`` (the
        #: fencing guard then stops the executions that ran across it and clears this).
        self.lapsed: float | None = None

    def run(self) -> None:
        cfg = self.rt.config
        # A renewal that goes unanswered (a store that stays connected and answers
        # nothing) is given up and made again on a fresh connection, not waited on.
        deadlines.thread_bound(cfg.renewal_deadline)
        failures = 0
        last_renewal = time.monotonic()
        while not self._stop_event.is_set():
            try:
                sent = time.monotonic()
                alive = self.store.heartbeat(self.owner, cfg.lease_seconds)
                gap = sent - self.renewal_sent_at
                if gap > cfg.fence_after:
                    # Renewed after the lease may have run out (the process was frozen, or
                    # the store blocked): another worker may have taken its claims in the
                    # meantime, and this renewal hides that from the fencing guard.
                    self.lapsed = gap
                    handed_claims.void_all()  # claims handed to waiting requests too
                self.renewal_sent_at = sent
                if alive:
                    handed_claims.lease_good_until(sent + cfg.fence_after)
                self.renewals += 1
                failures = 0
                wait = cfg.heartbeat_interval
                renewed_at = time.monotonic()
                if renewed_at - last_renewal > cfg.heartbeat_interval + cfg.lease_seconds / 4:
                    # Renewed, but late: the store was blocked (an SQLite write lock held by
                    # a long transaction), so nobody's renewals landed either. Count it as
                    # an outage: leases get a lease of grace.
                    self.last_failure = renewed_at
                    log.warning("lease renewal was %.1fs late", renewed_at - last_renewal
                                - cfg.heartbeat_interval, extra={"action": "lease_late"})
                last_renewal = renewed_at
                if not alive:
                    self.declared_dead = True
                if not alive and not self._declared_dead_logged:
                    self._declared_dead_logged = True
                    log.error("this worker (%s, incarnation %s) was declared dead by another "
                              "worker; its claims are being taken over. Is another worker "
                              "running with the same node name on a host that cannot see "
                              "this one's process?", self.owner.node, self.owner.incarnation,
                              extra={"action": "declared_dead"})
            except Exception as exc:
                failures += 1
                self.last_failure = time.monotonic()
                wait = backoff(self.rt, failures, cfg.heartbeat_interval / 2)
                log.warning("lease renewal failed (%s); retrying in %.1fs", exc, wait,
                            extra={"action": "lease_retry"})
            self._stop_event.wait(wait)
        self.store.dispose()

    def stop(self) -> None:
        self._stop_event.set()
