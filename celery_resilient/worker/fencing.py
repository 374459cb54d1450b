"""Self-fencing: a worker stops its resumable executions as soon as it may no longer own them.

Other workers take an incarnation's claims when its lease expires, or at once when its
liveness session is proven gone (:mod:`celery_resilient.store.liveness`). A worker that can
no longer renew its lease, or that lost its liveness session, cannot tell whether that has
happened. So :class:`FencingGuard` (a thread of the worker's main process, five ticks a second)
stops every pool process running resumable work. The guard does no I/O at all: it judges
from local monotonic times that the threads doing the round trips (the lease keeper,
:mod:`.lease`; the liveness session, :mod:`.liveness_session`) leave behind, so a store that
stays connected and answers nothing (a paused pooler, a stalled proxy, a frozen server)
cannot hold the fence back; those threads' round trips are bounded
(:mod:`celery_resilient.store.deadlines`) only so that they try again:

- **lease**: no renewal succeeded for ``lease_seconds - fence_margin`` (measured from the
  moment the last successful renewal was sent, so its expiry on the store's clock is at
  least ``fence_margin`` later), or one succeeded only after that long (a frozen process
  woken: the executions that ran across the gap are stopped once, the fence then lifts);
- **session**: the liveness session has not answered for ``SESSION_FENCE_AFTER`` (7 s)
  (broken, or silent behind a stalled link) and was not opened again, before the server
  could free the lock (11 s or more); or, opened again, it finds another worker took its
  work meanwhile;
- **declared dead**: another worker proved this incarnation gone. The worker then also shuts
  down (exit code 1), so its supervisor starts it again as a new incarnation.

Stopping is :class:`~.fence.Fence`'s (SIGKILL of those pool processes).
Celery sees the loss and, as ``ResumableTask`` sets ``reject_on_worker_lost``, gives the
message back to the broker; the work resumes from its last checkpoint wherever it is taken
next (a fence counts as one death of the work, as any lost execution does). While engaged,
executions that start are stopped at the next tick.
Plain tasks are left alone: they have no claim to lose.
"""

from __future__ import annotations

import logging
import threading
import time

from celery.worker import state as worker_state

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import liveness
from celery_resilient.worker.backpressure import ConsumptionGate
from celery_resilient.worker.fence import EX_FENCED, Fence
from celery_resilient.worker.lease import LeaseKeeper
from celery_resilient.worker.liveness_session import LivenessSession

log = logging.getLogger(__name__)
#: The guard's longest sleep: it judges from clocks only, so it can look often.
TICK_SECONDS = 0.2
#: Seconds after the last answered ping a lost session fences, unless opened again before:
#: the server frees the lock (so a proof can exist) no sooner than SERVER_DETECTS_AFTER
#: after the last packet it got; a session lost to a server restart (which no proof can
#: follow) is opened again within this and fences nothing.
SESSION_FENCE_AFTER = liveness.SERVER_DETECTS_AFTER - 4
#: Exit code of a worker another worker proved dead (a supervisor should start it again).
EX_DECLARED_DEAD = 1


class FencingGuard(threading.Thread):
    """Watches the lease and the liveness session from the clocks their threads leave, and
    engages the fence when either is lost (see the module docstring). Starts and stops the
    liveness session's thread with its own."""

    def __init__(self, rt: Runtime, owner: Owner, keeper: LeaseKeeper,
                 fence: Fence | None = None, gate: ConsumptionGate | None = None) -> None:
        super().__init__(name="celery-resilient-fencing", daemon=True)
        self.rt = rt
        self.owner = owner
        self.keeper = keeper
        self.fence = fence or Fence(gate, enabled=rt.config.self_fencing)
        url = rt.config.liveness_target
        self.session = (LivenessSession(rt, owner, url, keeper, self.fence)
                        if url is not None else None)
        self._stop_event = threading.Event()
        self.shut_down = False

    def describe(self) -> str:
        """The banner's word for how this incarnation's death can be proven."""
        session = self.session
        if session is None or session.refused is not None:
            cfg = self.rt.config
            why = (session.refused if session is not None else
                   "resilient_session_liveness=False" if not cfg.session_liveness
                   else "SQLite: same host only")
            return f"lease ({why})"
        return "session" if session.held else "session (not held yet)"

    def open_session(self) -> None:
        """Take the liveness lock (at start, before any claim is made)."""
        if self.session is not None:
            self.session.open()

    def start(self) -> None:
        super().start()
        if self.session is not None:
            self.session.start()

    def run(self) -> None:
        while not self._stop_event.wait(TICK_SECONDS):
            try:
                self.tick()
            except Exception:  # never let the guard die: log and go on
                log.exception("fencing guard round failed")

    def tick(self) -> None:
        """One judgement, from clocks and flags only (no I/O, no lock another thread holds
        across I/O)."""
        cfg = self.rt.config
        if self.keeper.declared_dead:
            self._declared_dead()
            return
        lapsed, self.keeper.lapsed = self.keeper.lapsed, None
        if lapsed is not None:  # renewed again, but too late: fence what ran across it
            self.fence.engage("lease", f"the lease went {lapsed:.1f}s without a renewal "
                              f"(lease {cfg.lease_seconds:g}s): another worker may own its "
                              "work now")
        unrenewed = time.monotonic() - self.keeper.renewal_sent_at
        if unrenewed > cfg.fence_after:
            self.fence.engage("lease", f"the lease was last renewed {unrenewed:.1f}s ago "
                              f"(lease {cfg.lease_seconds:g}s)")
        else:
            self.fence.release("lease")
        silent = self.session.silent_for() if self.session is not None else None
        if silent is not None and silent > SESSION_FENCE_AFTER:
            assert self.session is not None
            self.fence.engage("session", f"the liveness session has not answered for "
                              f"{silent:.1f}s ({self.session.lost_why or 'no reply'}); "
                              "another worker may soon prove this one gone")
        if self.fence.engaged and self.fence.enabled:
            self.fence.stop_executions()

    def _declared_dead(self) -> None:
        self.fence.engage("declared dead", "another worker proved this incarnation gone and "
                          "took its work")
        if not self.shut_down:
            self.shut_down = True
            log.critical("this worker (%s, incarnation %s) was declared dead; shutting down "
                         "so that it starts again as a new incarnation", self.owner.node,
                         self.owner.incarnation, extra={"action": "declared_dead_exit"})
            worker_state.should_stop = EX_DECLARED_DEAD  # Celery's loop raises WorkerShutdown

    def stop(self) -> None:
        self._stop_event.set()
        if self.session is not None:
            self.session.stop()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.session is not None and self.session.is_alive():
            self.session.join(timeout)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


__all__ = ["EX_DECLARED_DEAD", "EX_FENCED", "Fence", "FencingGuard"]
