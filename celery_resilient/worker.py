"""Worker bootstep: the main process's heartbeat and recovery sweeper.

They run in one background thread so a slow or unreachable store never stalls message
consumption; a store outage is logged and retried with backoff, never fatal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from celery import bootsteps

from . import identity, recovery
from .errors import ResilientError, StoreUnavailable
from .outcomes import RevokeWatcher
from .store.sql import Owner

if TYPE_CHECKING:
    from .app import Resilient

log = logging.getLogger(__name__)
REVOKE_POLL_SECONDS = 1.0


class Maintainer(threading.Thread):
    """Renews this incarnation's leases and re-publishes orphans, until stopped."""

    def __init__(self, rt: Resilient, owner: Owner) -> None:
        super().__init__(name="celery-resilient-maintainer", daemon=True)
        self.rt = rt
        self.owner = owner
        self._stop_event = threading.Event()
        self.rounds = 0
        self.revokes = RevokeWatcher()

    def flush_receipts(self) -> int:
        """Write every buffered delivery in one statement.

        A store outage keeps them for the next round. Any other error drops the batch (the
        broker still holds those messages unacked) rather than retry it forever and starve
        the heartbeat behind it.
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

    def run(self) -> None:
        cfg = self.rt.config
        next_heartbeat = next_sweep = time.monotonic()
        failures = 0
        while not self._stop_event.is_set():
            now = time.monotonic()
            try:
                self.flush_receipts()
                # Ended requests before the heartbeat and the sweep: an ended claim must
                # never be taken for an orphan.
                self.rt.outcomes.flush(self.rt)
                self.revokes.flush(self.rt)
                if now >= next_heartbeat:
                    self.rt.store.heartbeat(self.owner, cfg.lease_seconds, identity.pid_alive,
                                            self.rt.held.snapshot())
                    next_heartbeat = now + cfg.heartbeat_interval
                if now >= next_sweep:
                    recovery.sweep(self.rt, self.owner)
                    next_sweep = now + cfg.sweep_interval
                    self.rounds += 1
                failures = 0
                wait = max(0.0, min(next_heartbeat, next_sweep) - time.monotonic())
            except StoreUnavailable as exc:
                failures += 1
                wait = min(cfg.store_retry_base * 2 ** min(failures, 10), cfg.heartbeat_interval)
                log.warning("maintenance round failed (%s); retrying in %.1fs", exc, wait,
                            extra={"action": "store_retry"})
            except Exception:
                failures += 1
                wait = min(cfg.store_retry_base * 2 ** min(failures, 10), cfg.sweep_interval)
                log.exception("maintenance round failed; retrying in %.1fs", wait,
                              extra={"action": "maintenance_error"})
            if failures:
                self._stop_event.wait(wait)
            else:  # wake early for new receipts and outcomes; look at revokes every second
                self.rt.receipts.arrived.wait(min(wait, REVOKE_POLL_SECONDS))

    def stop(self) -> None:
        self._stop_event.set()
        self.rt.receipts.arrived.set()


class ResilientWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Start the maintainer once the worker's pool is up; hand claims back on a clean stop."""

    requires = {"celery.worker.components:Pool"}
    label = "celery-resilient"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.maintainer: Maintainer | None = None
        super().__init__(worker, **kwargs)

    def start(self, worker: Any) -> None:
        from .app import Resilient

        rt = Resilient.of(worker.app)
        owner = Owner(worker.hostname, identity.incarnation(), os.getpid())
        rt.startup(owner)
        self.maintainer = Maintainer(rt, owner)
        self.maintainer.start()

    def stop(self, worker: Any) -> None:
        if self.maintainer is None:
            return
        self.maintainer.stop()
        self.maintainer.join(timeout=5)
        try:
            self.maintainer.flush_receipts()
            self.maintainer.rt.outcomes.flush(self.maintainer.rt)
            self.maintainer.revokes.flush(self.maintainer.rt)
            self.maintainer.rt.store.mark_stopped(self.maintainer.owner,
                                                  self.maintainer.rt.config.submit_timeout)
        except ResilientError as exc:
            log.warning("could not hand claims back on shutdown: %s", exc)
        self.maintainer = None
