"""Worker bootstep: the incarnation's lease, the maintainer, and the warm-shutdown hand-off.

Two background threads, so a slow or unreachable store or broker never stalls message
consumption and nothing stands between a lease and its renewal:

- ``LeaseKeeper`` renews this incarnation's one lease row on a connection of its own. It
  runs from worker start until the pool has drained at shutdown, never behind a sweep, a
  re-publish, a receipt flush or a user's transaction.
- ``Maintainer`` flushes receipts and outcomes, copies revokes, releases claims that run
  nowhere, and sweeps orphans.

A warm shutdown (SIGTERM, SIGINT, ``celery control shutdown``) stops the sweeps, asks every
running ResumableTask to hand its work off at its next checkpoint (``resilient_shutdown``)
and keeps the lease alive while Celery drains the pool; the incarnation is marked stopped
only after the pool is empty (``worker_shutdown``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery import signals as celery_signals
from celery.worker.state import active_requests

from . import handoff, identity, liveness, recovery
from .backpressure import ConsumptionGate
from .errors import ResilientError, StoreUnavailable
from .outcomes import RevokeWatcher
from .store.sql import Owner, Store

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)
REVOKE_POLL_SECONDS = 1.0
#: A claim taken this recently may not be in Celery's active requests yet.
EXECUTING_GRACE_SECONDS = 5.0


def _backoff(rt: Resilient, failures: int, cap: float) -> float:
    return float(min(rt.config.store_retry_base * 2 ** min(failures, 10), cap))


class LeaseKeeper(threading.Thread):
    """Renews this incarnation's lease row until stopped, on its own store connection."""

    def __init__(self, rt: Resilient, owner: Owner) -> None:
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

    def run(self) -> None:
        cfg = self.rt.config
        failures = 0
        last_renewal = time.monotonic()
        while not self._stop_event.is_set():
            try:
                alive = self.store.heartbeat(self.owner, cfg.lease_seconds)
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
                wait = _backoff(self.rt, failures, cfg.heartbeat_interval / 2)
                log.warning("lease renewal failed (%s); retrying in %.1fs", exc, wait,
                            extra={"action": "lease_retry"})
            self._stop_event.wait(wait)
        self.store.dispose()

    def stop(self) -> None:
        self._stop_event.set()


def executing_task_ids() -> frozenset[str] | None:
    """Task ids Celery's pool is executing in this worker, or None if unreadable now."""
    try:
        return frozenset(r.id for r in list(active_requests))
    except RuntimeError:  # changed while copied: judge nothing this round
        return None


class Maintainer(threading.Thread):
    """Flushes receipts and outcomes, releases dead claims and sweeps orphans, until stopped."""

    def __init__(self, rt: Resilient, owner: Owner, keeper: LeaseKeeper | None = None,
                 gate: ConsumptionGate | None = None) -> None:
        super().__init__(name="celery-resilient-maintainer", daemon=True)
        self.rt = rt
        self.owner = owner
        self.keeper = keeper
        #: Stops message consumption while the store is unreachable.
        self.gate = gate
        self._stop_event = threading.Event()
        self.rounds = 0
        self.revokes = RevokeWatcher()
        #: Set at warm shutdown: no more sweeps (this worker is leaving).
        self.draining = False
        #: Monotonic time of the last failed round (None: none yet).
        self.last_failure: float | None = None

    def flush_receipts(self) -> int:
        """Write every buffered delivery in one statement.

        A store outage keeps them for the next round. Any other error drops the batch (the
        broker still holds those messages unacked) rather than retry it forever and starve
        the rounds behind it.
        """
        items = self.rt.receipts.take_all()
        if items:
            try:
                self.rt.store.record_receipts(items, self.owner, self.rt.config.lease_seconds)
            except StoreUnavailable:
                self.rt.receipts.put_back(items)
                raise
            except Exception:
                log.exception("dropped %d receipt(s) that cannot be written", len(items),
                              extra={"action": "receipt_dropped"})
                return 0
        return len(items)

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

    def reconcile(self) -> int:
        """Release this worker's claims that run nowhere (see ``Store.reconcile``)."""
        cfg = self.rt.config
        return self.rt.store.reconcile(
            self.owner, identity.pid_alive, self.rt.held.snapshot(), executing_task_ids(),
            EXECUTING_GRACE_SECONDS, self.rt.resent.snapshot(self.store_down_at()),
            2 * cfg.store_retry_max + cfg.sweep_interval, cfg.lease_seconds)

    def run(self) -> None:
        cfg = self.rt.config
        next_sweep = time.monotonic()
        failures = 0
        while not self._stop_event.is_set():
            now = time.monotonic()
            try:
                self.flush_receipts()
                # Ended requests before the sweep: an ended claim is never an orphan.
                self.rt.outcomes.flush(self.rt)
                self.revokes.flush(self.rt)
                if now >= next_sweep:
                    self.reconcile()
                    if time.monotonic() - now > cfg.lease_seconds / 4:
                        # This round waited on the store (an SQLite write lock held by a
                        # long transaction): others' renewals waited too. Grace, as after an
                        # outage.
                        self.last_failure = time.monotonic()
                    if not self.draining:
                        recovery.sweep(self.rt, self.owner, self.judge_leases())
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
                wait = _backoff(self.rt, failures, cfg.sweep_interval)
                log.warning("maintenance round failed (%s); retrying in %.1fs", exc, wait,
                            extra={"action": "store_retry"})
            except Exception:
                failures += 1
                self.last_failure = time.monotonic()
                wait = _backoff(self.rt, failures, cfg.sweep_interval)
                log.exception("maintenance round failed; retrying in %.1fs", wait,
                              extra={"action": "maintenance_error"})
            if failures:
                self._stop_event.wait(wait)
            else:  # wake early for new receipts and outcomes; look at revokes every second
                self.rt.receipts.arrived.wait(min(wait, REVOKE_POLL_SECONDS))

    def stop(self) -> None:
        self._stop_event.set()
        self.rt.receipts.arrived.set()


def settle_predecessors(rt: Resilient, owner: Owner) -> None:
    """At start: end earlier incarnations of this node that are provably dead; warn loudly
    about one that is alive (two workers with one node name), and leave its claims alone."""
    for other in rt.store.other_incarnations(owner):
        if liveness.is_dead(other.process):
            if rt.store.declare_dead(other.incarnation):
                log.info("earlier start of %s (incarnation %s, pid %d) is gone; its claims "
                         "are taken back now", owner.node, other.incarnation, other.pid,
                         extra={"action": "predecessor_dead",
                                "incarnation": other.incarnation})
            continue
        lease_end = other.lease_expires_at or other.heartbeat_at + rt.config.lease_seconds
        if lease_end <= other.db_now:
            continue  # its lease has expired: the sweep takes its claims back
        log.warning(
            "ANOTHER LIVE WORKER USES THE NODE NAME %s (incarnation %s, pid %d, %s; lease "
            "renewed %.0fs ago). Its claims are left alone, but give every worker a unique "
            "name (celery worker -n name@%%h).", owner.node, other.incarnation, other.pid,
            (other.process or "?").split(liveness.SEP)[0], other.db_now - other.heartbeat_at,
            extra={"action": "duplicate_node_name", "incarnation": other.incarnation})


class ResilientWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Start the lease keeper and the maintainer once the pool is up; hand off at shutdown."""

    requires = {"celery.worker.components:Pool"}
    label = "celery-resilient"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.maintainer: Maintainer | None = None
        self.keeper: LeaseKeeper | None = None
        self.hostname: str | None = None
        super().__init__(worker, **kwargs)

    def start(self, worker: Any) -> None:
        from .app import Resilient

        rt = Resilient.of(worker.app)
        owner = Owner(worker.hostname, identity.incarnation(), os.getpid())
        self.hostname = worker.hostname
        handoff.reset()
        rt.startup(owner)
        rt.receipts.max_bytes = rt.config.receipt_buffer_bytes
        rt.store.register(owner, liveness.current(), rt.config.lease_seconds)
        settle_predecessors(rt, owner)
        self.keeper = LeaseKeeper(rt, owner)
        self.keeper.start()
        self.maintainer = Maintainer(rt, owner, self.keeper, ConsumptionGate(worker))
        self.maintainer.start()
        celery_signals.worker_shutting_down.connect(self._on_shutting_down, weak=False)
        celery_signals.worker_shutdown.connect(self._on_shutdown, weak=False)

    def _on_shutting_down(self, sender: Any = None, how: str = "Warm", **_: Any) -> None:
        """Runs in Celery's signal handler: only raise the flag the pool processes read."""
        if sender == self.hostname and how == "Warm":
            self._request_hand_off()

    def _request_hand_off(self) -> None:
        if self.maintainer is not None and self.maintainer.rt.config.shutdown == "hand_off":
            handoff.request()

    def stop(self, worker: Any) -> None:
        """Warm shutdown, before the pool drains: hand off, keep the lease, stop sweeping."""
        if self.maintainer is None:
            return
        self._request_hand_off()
        self.maintainer.draining = True
        rt, owner = self.maintainer.rt, self.maintainer.owner
        try:
            rt.store.mark_draining(owner)
        except ResilientError as exc:
            log.warning("could not record the drain: %s", exc)
        log.info("warm shutdown: %s; lease kept until the pool has drained",
                 "running resumable work hands off at its next checkpoint"
                 if rt.config.shutdown == "hand_off" else "running work drains",
                 extra={"action": "draining"})

    def terminate(self, worker: Any) -> None:
        """Cold shutdown: the pool is killed next; the claims are orphans at once."""
        self._finish()

    def _on_shutdown(self, sender: Any = None, **_: Any) -> None:
        """``worker_shutdown``: the pool has drained."""
        if sender is not None and getattr(sender, "hostname", self.hostname) == self.hostname:
            self._finish()

    def _finish(self) -> None:
        maintainer, keeper = self.maintainer, self.keeper
        self.maintainer = self.keeper = None
        celery_signals.worker_shutting_down.disconnect(self._on_shutting_down)
        celery_signals.worker_shutdown.disconnect(self._on_shutdown)
        if maintainer is None:
            return
        maintainer.stop()
        maintainer.join(timeout=5)
        try:
            maintainer.flush_receipts()
            maintainer.rt.outcomes.flush(maintainer.rt)
            maintainer.revokes.flush(maintainer.rt)
            maintainer.rt.store.mark_stopped(maintainer.owner, maintainer.rt.config.submit_timeout)
        except ResilientError as exc:
            log.warning("could not hand claims back on shutdown: %s", exc)
        finally:
            if keeper is not None:
                keeper.stop()
                keeper.join(timeout=5)
