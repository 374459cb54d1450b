"""Automatic retention: ``Pruner`` deletes in bounded turns; ``PruneThread`` runs it.

Pruning has a thread of its own: a prune batch never delays the receipts, outcomes and sweeps
of the maintainer (a receipt written late widens the window in which a SIGKILL leaves a
prefetched message to the broker's own redelivery), and a prune that fails never pauses task
consumption (only the maintainer's and the lease's own duties judge a store outage).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from celery_resilient import signals
from celery_resilient.errors import StoreUnavailable
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import deadlines, retention, transient
from celery_resilient.tasks import context
from celery_resilient.worker.lease import backoff

log = logging.getLogger(__name__)

#: The time after which a turn stops pruning (it deletes at least one batch, so the longest
#: turn is this plus one batch); a round with more to delete goes on at the next turn.
PRUNE_TURN_SECONDS = 0.5
#: The longest pause between two turns of a round that has more to delete.
PRUNE_CONTINUE_SECONDS = 0.1
#: A prune batch the server cancelled (``statement_timeout``, SQLSTATE 57014) is tried again
#: at half its size, down to this many rows.
MIN_PRUNE_BATCH = 10
QUERY_CANCELED = "57014"


@dataclass
class _Job:
    """One table's part of a prune round: its cutoff on the database's clock."""

    name: str
    cutoff: float
    delete: Callable[[float, int], dict[str, int]]


class Pruner:
    """Automatic retention, in bounded turns (run by :class:`PruneThread`).

    A round starts every ``resilient_prune_interval`` (jittered, so the workers of a fleet
    spread their rounds; the first within one interval of the start); it takes the cutoffs
    once from the database's clock and deletes one batch per table in turn, round-robin,
    until every table's batch comes back short. A turn stops after
    :data:`PRUNE_TURN_SECONDS`, so a stop or a drain never waits behind a backlog.
    Deletes are idempotent: several workers pruning at once skip each other's rows.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.jobs: list[_Job] = []
        self.next_round: float | None = None  # monotonic; set at the first look
        self.totals: dict[str, int] = {}
        self.rounds = 0
        self._round_started = 0.0
        #: Rows per delete; halved while the server cancels batches for a statement timeout.
        self.batch = rt.config.prune_batch

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

        :class:`StoreUnavailable` propagates (the thread backs off; the round goes on after
        it; a batch the server cancelled for a statement timeout is halved first). Any other
        error is logged and ends the round: the next one starts after an interval.
        """
        started = time.monotonic()
        deleted: dict[str, int] = {}
        try:
            if not self.jobs:
                self.start_round()
            batch = self.batch
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
        except StoreUnavailable as exc:
            if transient.sqlstate(exc.__cause__ or exc) == QUERY_CANCELED and \
                    self.batch > MIN_PRUNE_BATCH:
                self.batch = max(MIN_PRUNE_BATCH, self.batch // 2)
                log.warning("prune batch cancelled by the server (statement timeout); "
                            "deleting %d rows at a time from now on", self.batch,
                            extra={"action": "prune_batch_halved", "count": self.batch})
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
        return {"work": done.work, "steps": done.steps}  # each checkpoint is in its work row

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


class PruneThread(threading.Thread):
    """Runs the :class:`Pruner`'s turns until stopped; paused while the worker drains."""

    def __init__(self, rt: Runtime) -> None:
        super().__init__(name="celery-resilient-pruner", daemon=True)
        self.rt = rt
        self.pruner = Pruner(rt)
        self.draining = False
        self._stop_event = threading.Event()

    def run(self) -> None:
        deadlines.thread_bound(self.rt.config.store_deadline)
        failures = 0
        while not self._stop_event.is_set():
            wait = 1.0  # the longest sleep: a stop or a due round is noticed within it
            if not self.draining and self.pruner.due(time.monotonic()):
                try:
                    self.pruner.turn()
                    failures = 0
                    if self.pruner.busy:
                        wait = PRUNE_CONTINUE_SECONDS
                except StoreUnavailable as exc:
                    failures += 1
                    wait = backoff(self.rt, failures, self.rt.config.prune_interval)
                    log.warning("prune turn failed (%s); retrying in %.1fs", exc, wait,
                                extra={"action": "prune_retry"})
            self._stop_event.wait(wait)

    def stop(self) -> None:
        self._stop_event.set()
