"""``Maintainer``: the worker's background thread for everything but the lease.

It flushes receipts and outcomes, copies revokes, releases claims that run nowhere, sweeps
orphans, and prunes what retention no longer keeps (:class:`Pruner`), so a slow or
unreachable store or broker never stalls message consumption.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from celery.worker.state import active_requests

from celery_resilient import signals
from celery_resilient.core import identity
from celery_resilient.core.identity import Owner
from celery_resilient.errors import StoreUnavailable
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import retention
from celery_resilient.tasks import context
from celery_resilient.worker import recovery
from celery_resilient.worker.backpressure import ConsumptionGate
from celery_resilient.worker.lease import LeaseKeeper, backoff
from celery_resilient.worker.receiving import RevokeWatcher

log = logging.getLogger(__name__)
REVOKE_POLL_SECONDS = 1.0
#: After a wake for new receipts, how long to let more arrive before one flush writes them
#: all: under load one statement carries many deliveries instead of one each.
RECEIPT_COALESCE_SECONDS = 0.005
#: A claim taken this recently may not be in Celery's active requests yet.
EXECUTING_GRACE_SECONDS = 5.0


#: The time after which a maintainer turn stops pruning (it deletes at least one batch, so the
#: longest turn is this plus one batch); a round with more to delete goes on at the next
#: turn, after the receipts, outcomes, revokes and sweep of that turn.
PRUNE_TURN_SECONDS = 0.5
#: The longest pause between two turns of a round that has more to delete.
PRUNE_CONTINUE_SECONDS = 0.1


def executing_task_ids() -> frozenset[str] | None:
    """Task ids Celery's pool is executing in this worker, or None if unreadable now."""
    try:
        return frozenset(r.id for r in list(active_requests))
    except RuntimeError:  # changed while copied: judge nothing this round
        return None


@dataclass
class _Job:
    """One table's part of a prune round: its cutoff on the database's clock."""

    name: str
    cutoff: float
    delete: Callable[[float, int], dict[str, int]]


class Pruner:
    """Automatic retention, run by the maintainer in bounded turns.

    A round starts every ``resilient_prune_interval`` (jittered, so the workers of a fleet
    spread their rounds; the first within one interval of the start); it takes the cutoffs
    once from the database's clock and deletes one batch per table in turn, round-robin,
    until every table's batch comes back short. A turn stops after
    :data:`PRUNE_TURN_SECONDS`, so the maintainer's other duties never wait behind a backlog.
    Deletes are idempotent: several workers pruning at once skip each other's rows.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.jobs: list[_Job] = []
        self.next_round: float | None = None  # monotonic; set at the first look
        self.totals: dict[str, int] = {}
        self.rounds = 0
        self._round_started = 0.0

    @property
    def busy(self) -> bool:
        """A round has more to delete."""
        return bool(self.jobs)

    def due(self, now: float) -> bool:
        if self.busy:
            return True
        if self.next_round is None:
            self.next_round = now + random.uniform(0.0, self.rt.config.prune_interval)
        return now >= self.next_round

    def _schedule(self, now: float) -> None:
        self.next_round = now + self.rt.config.prune_interval * random.uniform(0.75, 1.25)

    def start_round(self) -> None:
        """Take the cutoffs (one read of the database's clock) and queue every table."""
        cfg, store = self.rt.config, self.rt.store
        wanted = [(name, age, fn) for name, age, fn in (
            ("work", cfg.work_retention, self._work),
            ("revocations", cfg.work_retention, self._revocations),
            ("ledger", cfg.ledger_retention, self._ledger),
            ("workers", cfg.worker_row_retention, self._workers),
            ("schedule_runs", cfg.beat_run_retention, self._beat_runs),
            ("contexts", cfg.context_retention, self._contexts),
        ) if age is not None]
        if not wanted:
            return
        now = store.now()
        self.jobs = [_Job(name, now - age, fn) for name, age, fn in wanted]
        self.totals = {}
        self._round_started = time.monotonic()

    def turn(self) -> dict[str, int]:
        """One bounded turn: start a round if none is under way, delete batches until the
        round ends or :data:`PRUNE_TURN_SECONDS` passed. Returns the rows deleted, by table.

        :class:`StoreUnavailable` propagates (the maintainer backs off; the round goes on
        after it). Any other error is logged and ends the round: the next one starts after
        an interval, and the maintainer's other duties are not held back.
        """
        started = time.monotonic()
        deleted: dict[str, int] = {}
        try:
            if not self.jobs:
                self.start_round()
            batch = self.rt.config.prune_batch
            while self.jobs:  # at least one batch a turn, then until the time is spent
                job = self.jobs[0]
                counts = job.delete(job.cutoff, batch)  # StoreUnavailable: the job stays
                self.jobs.pop(0)
                for table, n in counts.items():
                    if n:
                        deleted[table] = deleted.get(table, 0) + n
                        self.totals[table] = self.totals.get(table, 0) + n
                        signals.send(signals.rows_pruned, self.rt.app, table, table=table,
                                     rows=n)
                if counts.get(job.name, 0) >= batch:
                    self.jobs.append(job)  # full: there may be more, after the others
                if time.monotonic() - started >= PRUNE_TURN_SECONDS:
                    break
        except StoreUnavailable:
            raise
        except Exception:
            log.exception("prune round failed; the next one starts in about %.0fs",
                          self.rt.config.prune_interval, extra={"action": "prune_error"})
            self.jobs = []
        if not self.jobs:
            self._end_round()
        return deleted

    def _end_round(self) -> None:
        self._schedule(time.monotonic())
        self.rounds += 1
        if self.totals:
            total = sum(self.totals.values())
            log.info("pruned %d rows past their retention (%s) in %.2fs", total,
                     ", ".join(f"{t}={n}" for t, n in sorted(self.totals.items())),
                     time.monotonic() - self._round_started,
                     extra={"action": "pruned", "count": total, "tables": dict(self.totals)})
        self.totals = {}

    # -- one batch of each table ------------------------------------------------------------

    def _work(self, cutoff: float, batch: int) -> dict[str, int]:
        done = retention.delete_finished_work(self.rt.store, cutoff, batch)
        return {"work": done.work, "checkpoints": done.checkpoints, "steps": done.steps}

    def _revocations(self, cutoff: float, batch: int) -> dict[str, int]:
        return {"revocations": retention.delete_revocations(self.rt.store, cutoff, batch)}

    def _ledger(self, cutoff: float, batch: int) -> dict[str, int]:
        return {"ledger": retention.delete_ledger_markers(self.rt.store, cutoff, batch)}

    def _workers(self, cutoff: float, batch: int) -> dict[str, int]:
        return {"workers": retention.delete_ended_workers(
            self.rt.store, cutoff, self.rt.config.lease_seconds, batch)}

    def _beat_runs(self, cutoff: float, batch: int) -> dict[str, int]:
        return {"schedule_runs": retention.delete_beat_runs(self.rt.store, cutoff, batch)}

    def _contexts(self, cutoff: float, batch: int) -> dict[str, int]:
        keys = retention.delete_contexts(self.rt.store, cutoff, batch)
        if keys:  # the app's context cache (Redis or in-process) must not serve them
            context.for_app(self.rt.app).invalidate(keys)
        return {"contexts": len(keys)}


class Maintainer(threading.Thread):
    """Flushes receipts and outcomes, releases dead claims, sweeps orphans and prunes old
    rows (in bounded turns, see :class:`Pruner`), until stopped."""

    def __init__(self, rt: Runtime, owner: Owner, keeper: LeaseKeeper | None = None,
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
        self.pruner = Pruner(rt)

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
                if not self.draining and self.pruner.due(time.monotonic()):
                    self.pruner.turn()
                failures = 0
                if self.gate is not None:
                    self.gate.store_up()
                wait = max(0.0, next_sweep - time.monotonic())
                if self.pruner.busy:
                    wait = min(wait, PRUNE_CONTINUE_SECONDS)
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

    def stop(self) -> None:
        self._stop_event.set()
        self.rt.receipts.arrived.set()
