"""``Maintainer``: the worker's background thread for everything but the lease.

It flushes receipts and outcomes, copies revokes, releases claims that run nowhere and sweeps
orphans, so a slow or unreachable store or broker never stalls message consumption. It starts
and stops the pruning thread beside it (:mod:`.pruner`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from celery.worker.state import active_requests

from celery_resilient.broker.generation import BrokerMarker
from celery_resilient.broker.identity import BrokerIdentity
from celery_resilient.core import identity
from celery_resilient.core.identity import Owner
from celery_resilient.errors import StoreUnavailable
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import deadlines
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.sql import PROVEN_DEAD, Receipt
from celery_resilient.tasks import handed_claims
from celery_resilient.worker import pruner, recovery
from celery_resilient.worker.backpressure import ConsumptionGate
from celery_resilient.worker.holding_sweep import HoldingSweep
from celery_resilient.worker.lease import LeaseKeeper, backoff
from celery_resilient.worker.receiving import RevokeWatcher

log = logging.getLogger(__name__)
REVOKE_POLL_SECONDS = 1.0
#: After a wake for new receipts, how long to let more arrive before one flush writes them
#: all: under load one statement carries many deliveries instead of one each.
RECEIPT_COALESCE_SECONDS = 0.005
#: Seconds the broker may be unreachable before this worker lets go of its prefetched work.
BROKER_LOST_AFTER = 10.0
#: Heartbeats an incarnation may miss before a sweep probes its liveness session.
SUSPECT_AFTER_BEATS = 1.5
#: A claim taken this recently may not be in Celery's active requests yet.
EXECUTING_GRACE_SECONDS = 5.0


def executing_task_ids() -> frozenset[str] | None:
    """Task ids Celery's pool is executing in this worker, or None if unreadable now."""
    try:
        return frozenset(r.id for r in list(active_requests))
    except RuntimeError:  # changed while copied: judge nothing this round
        return None


def store_marker(rt: Runtime) -> BrokerMarker:
    """The marker of ``rt``'s store in its broker (one per store URL and table prefix)."""
    return BrokerMarker(f"{sanitize_url(rt.config.store_url)} {rt.config.table_prefix}")


class Maintainer(threading.Thread):
    """Flushes receipts and outcomes, releases dead claims and sweeps orphans until stopped;
    retention runs beside it on :class:`~celery_resilient.worker.pruner.PruneThread`."""

    def __init__(self, rt: Runtime, owner: Owner, keeper: LeaseKeeper | None = None,
                 gate: ConsumptionGate | None = None, marker: BrokerMarker | None = None,
                 broker: BrokerIdentity | None = None) -> None:
        super().__init__(name="celery-resilient-maintainer", daemon=True)
        self.rt = rt
        self.owner = owner
        self.keeper = keeper
        #: Stops message consumption while the store is unreachable.
        self.gate = gate
        self._stop_event = threading.Event()
        self.rounds = 0
        self.revokes = RevokeWatcher()
        #: Gives back what gone workers held on a Redis broker (the reliable fetch).
        self.holding = HoldingSweep(rt, owner)
        #: Tells when the broker lost its data (a Redis restarted empty).
        self.marker = marker or store_marker(rt)
        #: The broker this incarnation recorded (None: it records none), kept current with
        #: the broker's token, which a broker that lost its data gets anew.
        self.broker = broker
        #: Monotonic time of the last failed round (None: none yet).
        self.last_failure: float | None = None
        self.pruning = pruner.PruneThread(rt)
        self.pruner = self.pruning.pruner
        self._draining = False
        self._broker_down_since: float | None = None
        self._broker_released = False

    @property
    def draining(self) -> bool:
        """Set at warm shutdown: no more sweeps or prunes (this worker is leaving)."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = self.pruning.draining = value

    def start(self) -> None:
        super().start()
        self.pruning.start()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.pruning.is_alive():
            self.pruning.join(timeout)

    def flush_receipts(self) -> int:
        """Write every buffered delivery in one statement.

        Only deliveries still held are written. A store outage keeps them for the next
        round. Any other error writes them one by one and drops only those that fail (the
        broker still holds those messages unacked) rather than retry them forever and
        starve the rounds behind them.
        """
        items = self.rt.receipts.take_all()
        # A delivery acked or rejected before its receipt was written (during a store outage,
        # or within the coalescing window) is no longer this worker's: recording it would
        # reserve the work for a message nobody holds.
        held = self.rt.unacked.among(r.task_id for r in items)
        items = [r for r in items if r.task_id in held]
        if items:
            try:
                self.rt.store.record_receipts(items, self.owner, self.rt.config.lease_seconds)
            except StoreUnavailable:
                self.rt.receipts.put_back(items)
                raise
            except Exception:
                if len(items) == 1:
                    log.exception("dropped 1 receipt(s) that cannot be written (%s)",
                                  items[0].task_id, extra={"action": "receipt_dropped"})
                    return 0
                return self._record_one_by_one(items)
        return len(items)

    def _record_one_by_one(self, items: list[Receipt]) -> int:
        """A batch the store refused: each receipt alone, so one bad delivery (a message
        over the MySQL packet limit, say) costs only its own."""
        written = 0
        for i, item in enumerate(items):
            try:
                self.rt.store.record_receipts([item], self.owner, self.rt.config.lease_seconds)
            except StoreUnavailable:
                self.rt.receipts.put_back(items[i:])
                raise
            except Exception:
                log.exception("dropped 1 receipt(s) that cannot be written (%s)",
                              item.task_id, extra={"action": "receipt_dropped"})
                continue
            written += 1
        return written

    def store_down_at(self) -> float | None:
        """Monotonic time this worker last failed to reach the store (None: never)."""
        failures = [t for t in (self.last_failure,
                                self.keeper.last_failure if self.keeper else None)
                    if t is not None]
        return max(failures) if failures else None

    def judge_leases(self) -> bool:
        """Whether other owners' expired leases mean they are gone.

        Not within one lease after the store was unreachable (from here, or restarted): the
        other owners could not renew either, and need a full lease to reach it again.
        """
        lease = self.rt.config.lease_seconds
        down_at = self.store_down_at()
        if down_at is not None and time.monotonic() - down_at < lease:
            return False
        up_for = self.rt.store.up_for()
        return up_for is None or up_for >= lease

    def broker_seen(self, answered: bool) -> None:
        """After each sweep's broker check: a worker cut off from its broker for
        :data:`BROKER_LOST_AFTER` lets go of its prefetched resumable work, whose reserved
        claims other workers' sweeps then re-publish from the store (Celery may take long to
        notice an idle consumer's link is gone). What it still holds runs nothing twice: a
        copy that reaches a worker after the work was taken or done is skipped."""
        now = time.monotonic()
        if answered:
            if self._broker_released:
                log.info("broker reachable again", extra={"action": "broker_back"})
            self._broker_down_since = None
            self._broker_released = False
            return
        if self._broker_down_since is None:
            self._broker_down_since = now
        down = now - self._broker_down_since
        if down >= BROKER_LOST_AFTER and not self._broker_released:
            handed_claims.void_all()  # its pool processes take their own claims from now on
            released = self.rt.store.release_reserved(self.owner)
            self._broker_released = True
            log.warning("broker unreachable for %.0fs: %d prefetched resumable claim(s) let "
                        "go for other workers", down, released,
                        extra={"action": "prefetched_released", "count": released})

    def probe_suspects(self) -> int:
        """End the lease of incarnations whose heartbeat is late and whose liveness session
        has ended (PostgreSQL): their resumable work is taken back now, not when their lease
        would have expired. A dead host's session ends once the server's keepalives give up
        on it; a worker only cut off has fenced itself by then, and renews its lease again
        when it comes back."""
        proven = 0
        stale = SUSPECT_AFTER_BEATS * self.rt.config.heartbeat_interval
        for incarnation in self.rt.store.lock_suspects(self.owner, stale):
            if self.rt.store.prove_dead(incarnation) == PROVEN_DEAD:
                proven += 1
                log.info("incarnation %s lost its database session: its lease is ended and its "
                         "resumable work taken back now", incarnation,
                         extra={"action": "lease_ended_by_session", "incarnation": incarnation})
        return proven

    def reconcile(self) -> int:
        """Release this worker's claims that run nowhere (see ``Store.reconcile``)."""
        cfg = self.rt.config
        executing = executing_task_ids()
        # after what executes: a body that ended since has its result handed over by now
        dispatcher = self.rt.dispatcher
        finishing = dispatcher.finishing() if dispatcher is not None else frozenset()
        return self.rt.store.reconcile(
            self.owner, identity.pid_alive, self.rt.unacked.snapshot(), executing,
            EXECUTING_GRACE_SECONDS, self.rt.resent.snapshot(self.store_down_at()),
            2 * cfg.store_retry_max + cfg.sweep_interval, cfg.lease_seconds, finishing)

    def run(self) -> None:
        cfg = self.rt.config
        deadlines.thread_bound(cfg.store_deadline)  # a silent store fails a round, not hangs it
        next_sweep = next_revokes = time.monotonic()
        failures = 0
        while not self._stop_event.is_set():
            now = time.monotonic()
            try:
                self.flush_receipts()
                # Ended requests before the sweep: an ended claim is never an orphan.
                self.rt.outcomes.flush(self.rt.store)
                if now >= next_revokes or now >= next_sweep:  # a copy of the whole list
                    self.revokes.flush(self.rt)
                    next_revokes = now + REVOKE_POLL_SECONDS
                if now >= next_sweep:
                    self.probe_suspects()
                    self.reconcile()
                    if time.monotonic() - now > cfg.lease_seconds / 4:
                        # This round waited on the store (an SQLite write lock held by a
                        # long transaction): others' renewals waited too. Grace, as after an
                        # outage.
                        self.last_failure = time.monotonic()
                    if not self.draining:
                        recovery.sweep(self.rt, self.owner, self.judge_leases(), self.holding,
                                       self.broker_seen, self.marker)
                        self.record_broker_token()
                    next_sweep = now + cfg.sweep_interval
                    self.rounds += 1
                failures = 0
                if self.gate is not None:
                    self.gate.store_up()
                wait = max(0.0, next_sweep - time.monotonic())
            except StoreUnavailable as exc:
                failures += 1
                self.last_failure = time.monotonic()
                if self.gate is not None:
                    self.gate.store_down(str(exc))
                wait = backoff(self.rt, failures, cfg.sweep_interval)
                log.warning("maintenance round failed (%s); retrying in %.1fs", exc, wait,
                            extra={"action": "store_retry"})
            except Exception:
                failures += 1
                self.last_failure = time.monotonic()
                wait = backoff(self.rt, failures, cfg.sweep_interval)
                log.exception("maintenance round failed; retrying in %.1fs", wait,
                              extra={"action": "maintenance_error"})
            if failures:
                self._stop_event.wait(wait)
            elif self.rt.receipts.arrived.wait(min(wait, REVOKE_POLL_SECONDS)):
                # woken early for new receipts or outcomes: let a burst gather first
                self._stop_event.wait(RECEIPT_COALESCE_SECONDS)

    def record_broker_token(self) -> None:
        """Record the broker's token when it changed (unread at start, or new after the
        broker lost its data), so workers starting later on this broker, through whatever
        address, are recognised as its own."""
        token = self.marker.broker_token
        if self.broker is None or token is None or token == self.broker.token:
            return
        broker = dataclasses.replace(self.broker, token=token)
        self.rt.store.record_broker(self.owner, broker.dumps())
        self.broker = broker

    def give_back_first(self) -> None:
        """Before the consumer starts: what gone incarnations held (a predecessor this
        start just proved dead) goes back to the front of its queues, so this worker's
        first fetch takes it, not the backlog behind it. Anything that fails here is left
        to the first sweep."""
        try:
            recovery.give_back_held(self.rt, self.holding, self.judge_leases())
        except Exception as exc:
            log.warning("held messages not given back before consuming (%s); the first "
                        "sweep does", exc, extra={"action": "holding_restore_failed"})

    def stop(self) -> None:
        self._stop_event.set()
        self.pruning.stop()
        self.rt.receipts.arrived.set()
