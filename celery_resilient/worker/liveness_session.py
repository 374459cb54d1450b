"""``LivenessSession``: holds this incarnation's liveness lock, on a thread of its own.

The lock (:mod:`celery_resilient.store.liveness`) lets another worker prove this one gone the
moment its database session ends. This thread pings the session every ``PING_SECONDS``, opens
it again when it is lost, and records the lock in the store. It does all the I/O of the
session proof, so the fencing guard (:mod:`.fencing`), which judges from :meth:`silent_for`
alone, never waits on the store. Every round trip is bounded (``PING_DEADLINE``; the store's
records by ``renewal_deadline``): a link that stays open and answers nothing is lost within
seconds, not when TCP gives up, which it never does while the peer acknowledges.
"""

from __future__ import annotations

import logging
import threading
import time

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import deadlines, liveness
from celery_resilient.store.liveness_mysql import MySQLSessionLock
from celery_resilient.worker.fence import Fence
from celery_resilient.worker.lease import LeaseKeeper

log = logging.getLogger(__name__)


class LivenessSession(threading.Thread):
    """Pings and reopens the liveness session; tells the fence what the store reported."""

    def __init__(self, rt: Runtime, owner: Owner, url: str, keeper: LeaseKeeper,
                 fence: Fence) -> None:
        super().__init__(name="celery-resilient-liveness", daemon=True)
        self.rt = rt
        self.owner = owner
        self.keeper = keeper
        self.fence = fence
        self.lock: liveness.SessionLock | MySQLSessionLock | None = liveness.session_lock(
            url, rt.config.table_prefix, owner.incarnation)
        self._stop_event = threading.Event()
        self._warned_held = False
        #: Monotonic time of the last round trip the held session answered (None: never held).
        self._last_ok: float | None = None
        #: Why the session was last lost ("" while it answers).
        self.lost_why = ""
        #: Why the session proof was given up at start (None: it was not).
        self.refused: str | None = None

    @property
    def held(self) -> bool:
        return self.lock is not None and self.lock.held

    def silent_for(self) -> float | None:
        """Seconds since the session last answered, while the proof is in use; None before
        it was first held or once it was given up. No I/O: the guard reads it."""
        if self.lock is None or self._last_ok is None:
            return None
        return time.monotonic() - self._last_ok

    def open(self) -> None:
        """Take the lock (at start, before any claim is made)."""
        with deadlines.bounded(self.rt.config.renewal_deadline):
            self._acquire()

    def run(self) -> None:
        deadlines.thread_bound(self.rt.config.renewal_deadline)
        while not self._stop_event.wait(liveness.PING_SECONDS):
            try:
                self.round()
            except Exception:  # never let the session thread die: log and go on
                log.exception("liveness session round failed")

    def round(self) -> None:
        lock = self.lock
        if lock is None:
            return
        if lock.held:
            try:
                lock.ping()
                self._last_ok = lock.last_ok
                return
            except Exception as exc:
                self.lost_why = str(exc)
                lock.drop()
                log.warning("the liveness session was lost (%s); opening it again", exc,
                            extra={"action": "liveness_lost"})
        self._acquire()

    def _acquire(self) -> None:
        lock = self.lock
        assert lock is not None
        try:
            server = lock.acquire()
        except Exception as exc:
            log.warning("liveness session not open (%s); retrying", exc,
                        extra={"action": "liveness_retry"})
            return
        if server is None:
            if not self._warned_held:
                self._warned_held = True
                log.warning("the liveness lock of this incarnation is held by another "
                            "session (a probe right now, or a key shared by chance); "
                            "retrying", extra={"action": "liveness_held"})
            return
        store = self.rt.store
        try:
            if not store.sees_liveness_lock(self.owner):
                self._refuse()
                return
            marked = store.take_session_mark(self.owner)
            alive = store.heartbeat(self.owner, self.rt.config.lease_seconds)
            if alive:
                store.record_liveness(self.owner, server)
        except Exception as exc:  # the store went away: drop the lock, record it later
            lock.drop()
            log.warning("could not record the liveness session (%s); retrying", exc,
                        extra={"action": "liveness_retry"})
            return
        if not alive:
            self.keeper.declared_dead = True  # the guard shuts the worker down
            return
        if marked:  # its resumable work was taken while the session was gone
            self.fence.engage("session", "another worker found this one's session ended and "
                              "took its resumable work")
        self._warned_held = False
        self._last_ok = lock.last_ok
        self.lost_why = ""
        self.fence.release("session")

    def _refuse(self) -> None:
        """The lock is held where the store's probes cannot see it: give up the session
        proof rather than be proven dead while alive."""
        assert self.lock is not None
        self.lock.dispose()
        self.lock = None
        self.refused = ("resilient_liveness_url does not reach the store's database: "
                        "session proof off")
        log.error("resilient_liveness_url reaches another database or server than the store "
                  "(the store's database does not see this worker's liveness lock, so every "
                  "probe would prove this worker dead while it runs); the session proof is "
                  "off and this worker's death is proven by its lease. Point "
                  "resilient_liveness_url at the store's own database, directly.",
                  extra={"action": "liveness_misconfigured"})

    def stop(self) -> None:
        self._stop_event.set()

    def close(self) -> None:
        if self.lock is not None:
            self.lock.dispose()

__all__ = ["LivenessSession"]
