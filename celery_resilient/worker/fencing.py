"""Self-fencing: a worker stops its resumable executions as soon as it may no longer own them.

Other workers take an incarnation's claims when its lease expires, or at once when its
liveness session is proven gone (:mod:`celery_resilient.store.liveness`). A worker that can
no longer renew its lease, or that lost its liveness session, cannot tell whether that has
happened. So :class:`FencingGuard` (a thread of the worker's main process, one tick a second)
stops every pool process running resumable work:

- **lease**: no renewal succeeded for ``lease_seconds - fence_margin`` (measured from the
  moment the last successful renewal was sent, so its expiry on the store's clock is at
  least ``fence_margin`` later), or one succeeded only after that long (a frozen process
  woken: the executions that ran across the gap are stopped once, the fence then lifts);
- **session**: the liveness session broke and could not be opened again within
  ``SESSION_FENCE_AFTER`` (7 s) of its last answered ping, before the server could free the
  lock (11 s or more); or, opened again, it finds another worker took its work meanwhile;
- **declared dead**: another worker proved this incarnation gone. The worker then also shuts
  down (exit code 1), so its supervisor starts it again as a new incarnation.

Stopping is SIGKILL of those pool processes (a pool without child processes, such as solo or
threads, runs the task in the worker's own process: the worker then exits with code 3).
Celery sees the loss and, as ``ResumableTask`` sets ``reject_on_worker_lost``, gives the
message back to the broker; the work resumes from its last checkpoint wherever it is taken
next (a fence counts as one death of the work, as any lost execution does). While engaged,
executions that start are stopped at the next tick.
Plain tasks are left alone: they have no claim to lose.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from celery.worker import state as worker_state

from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store import liveness
from celery_resilient.tasks import handed
from celery_resilient.tasks.task import ResumableTask
from celery_resilient.worker.backpressure import ConsumptionGate
from celery_resilient.worker.lease import LeaseKeeper

log = logging.getLogger(__name__)
TICK_SECONDS = liveness.PING_SECONDS
#: Seconds after the last answered ping a lost session fences, unless opened again before:
#: the server frees the lock (so a proof can exist) no sooner than SERVER_DETECTS_AFTER
#: after the last packet it got; a session lost to a server restart (which no proof can
#: follow) is opened again within this and fences nothing.
SESSION_FENCE_AFTER = liveness.SERVER_DETECTS_AFTER - 4
#: Exit code of a worker another worker proved dead (a supervisor should start it again).
EX_DECLARED_DEAD = 1
#: Exit code of a worker that fenced a resumable execution running in its own process.
EX_FENCED = 3


class Fence:
    """Why this worker's resumable executions must not run now, and stopping them. While
    engaged the worker takes no work (``gate``), so it does not sit on messages it cannot
    run while other workers could."""

    def __init__(self, gate: ConsumptionGate | None = None, enabled: bool = True) -> None:
        self._reasons: dict[str, float] = {}
        self._lock = threading.Lock()
        self.stopped: list[int] = []
        self.gate = gate
        #: ``resilient_self_fencing``: False logs what would be fenced and stops nothing.
        self.enabled = enabled

    @property
    def engaged(self) -> bool:
        return bool(self._reasons)

    def engage(self, reason: str, detail: str) -> None:
        with self._lock:
            new = reason not in self._reasons
            self._reasons.setdefault(reason, time.monotonic())
        if new and not self.enabled:
            log.error("NOT SELF-FENCING (%s, resilient_self_fencing=False): %s; this worker's "
                      "resumable executions go on, and may overlap with another worker's",
                      reason, detail, extra={"action": "self_fencing_off", "reason": reason})
        if not self.enabled:
            return
        if new:
            log.error("SELF-FENCING (%s): %s; stopping this worker's resumable executions "
                      "(they resume from their checkpoints wherever they are taken next)",
                      reason, detail, extra={"action": "self_fenced", "reason": reason})
            if self.gate is not None:
                self.gate.fence(reason)
            handed.void_all()  # requests waiting for the pool take their own claims
        self.stop_executions()

    def release(self, reason: str) -> None:
        with self._lock:
            was = self._reasons.pop(reason, None)
            lifted = was is not None and not self._reasons
        if lifted and self.gate is not None and self.enabled:
            self.gate.unfence()
        if lifted:
            log.warning("fence lifted (%s restored after %.1fs): resumable work runs here again",
                        reason, time.monotonic() - (was or 0.0),
                        extra={"action": "fence_lifted", "reason": reason})

    def stop_executions(self) -> list[int]:
        """SIGKILL every pool process running a resumable task; return their pids."""
        try:
            running = list(worker_state.active_requests)
        except RuntimeError:  # changed while copied: the next tick
            return []
        pids: list[int] = []
        for request in running:
            pid = getattr(request, "worker_pid", None)
            if not pid or not isinstance(request.task, ResumableTask):
                continue
            if pid == os.getpid():
                self._exit_in_process(request)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            pids.append(pid)
            log.error("fenced: stopped pool process %d running %s[%s]", pid, request.name,
                      request.id, extra={"action": "execution_fenced", "task_id": request.id})
        self.stopped.extend(pids)
        return pids

    @staticmethod
    def _exit_in_process(request: object) -> None:
        """The pool runs tasks in this very process (solo, threads, eventlet, gevent): the
        only way to stop the execution is to end the worker. Its messages come back as any
        dead worker's do; a supervisor starts it again."""
        log.critical("fenced: %s[%s] runs in the worker's own process (a pool without child "
                     "processes): the worker exits (code %d) to stop it", getattr(
                         request, "name", "?"), getattr(request, "id", "?"), EX_FENCED,
                     extra={"action": "execution_fenced_exit"})
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EX_FENCED)


class FencingGuard(threading.Thread):
    """Holds the liveness session and watches the lease; engages the fence when either is
    lost (see the module docstring)."""

    def __init__(self, rt: Runtime, owner: Owner, keeper: LeaseKeeper,
                 fence: Fence | None = None, gate: ConsumptionGate | None = None) -> None:
        super().__init__(name="celery-resilient-fencing", daemon=True)
        self.rt = rt
        self.owner = owner
        self.keeper = keeper
        self.fence = fence or Fence(gate, enabled=rt.config.self_fencing)
        url = rt.config.liveness_target
        self.session = (liveness.SessionLock(url, rt.config.table_prefix, owner.incarnation)
                        if url is not None else None)
        self._stop_event = threading.Event()
        self._warned_held = False
        self.shut_down = False
        #: Monotonic time of the last ping that answered before the session was lost.
        self._lost_since: float | None = None
        self._lost_why = ""
        #: Why the session proof was given up at start (None: it was not).
        self._refused: str | None = None

    def describe(self) -> str:
        """The banner's word for how this incarnation's death can be proven."""
        if self.session is None:
            cfg = self.rt.config
            why = self._refused or ("resilient_session_liveness=False"
                                    if not cfg.session_liveness else "SQLite: same host only")
            return f"lease ({why})"
        return "session" if self.session.held else "session (not held yet)"

    def open_session(self) -> None:
        """Take the liveness lock (at start, before any claim is made)."""
        if self.session is not None:
            self._acquire()

    def run(self) -> None:
        while not self._stop_event.wait(TICK_SECONDS):
            try:
                self.tick()
            except Exception:  # never let the guard die: log and go on
                log.exception("fencing guard round failed")

    def tick(self) -> None:
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
        if self.session is not None:
            if self.session.held:
                try:
                    self.session.ping()
                except Exception as exc:
                    self._lost_since = self.session.last_ok
                    self._lost_why = str(exc)
                    self.session.drop()
                    log.warning("the liveness session was lost (%s); opening it again", exc,
                                extra={"action": "liveness_lost"})
            if not self.session.held:
                self._acquire()
            lost = self._lost_since
            if (not self.session.held and lost is not None
                    and time.monotonic() - lost > SESSION_FENCE_AFTER):
                self.fence.engage("session", f"the liveness session is lost "
                                  f"({self._lost_why}); another worker may soon prove this "
                                  "one gone")
        if self.fence.engaged and self.fence.enabled:
            self.fence.stop_executions()

    def _acquire(self) -> None:
        assert self.session is not None
        try:
            server = self.session.acquire()
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
        try:
            if not self.rt.store.sees_liveness_lock(self.owner):
                self._refuse_session()
                return
            marked = self.rt.store.take_session_mark(self.owner)
            alive = self.rt.store.heartbeat(self.owner, self.rt.config.lease_seconds)
            if alive:
                self.rt.store.record_liveness(self.owner, server)
        except Exception as exc:  # the store went away: keep the lock, record it later
            self.session.drop()
            log.warning("could not record the liveness session (%s); retrying", exc,
                        extra={"action": "liveness_retry"})
            return
        if not alive:
            self.keeper.declared_dead = True
            self._declared_dead()
            return
        if marked:  # its resumable work was taken while the session was gone
            self.fence.engage("session", "another worker found this one's session ended and "
                              "took its resumable work")
        self._warned_held = False
        self._lost_since = None
        self.fence.release("session")

    def _refuse_session(self) -> None:
        """The lock is held where the store's probes cannot see it: give up the session
        proof rather than be proven dead while alive."""
        assert self.session is not None
        self.session.dispose()
        self.session = None
        self._refused = ("resilient_liveness_url does not reach the store's database: "
                         "session proof off")
        log.error("resilient_liveness_url reaches another database or server than the store "
                  "(the store's database does not see this worker's liveness lock, so every "
                  "probe would prove this worker dead while it runs); the session proof is "
                  "off and this worker's death is proven by its lease. Point "
                  "resilient_liveness_url at the store's own database, directly.",
                  extra={"action": "liveness_misconfigured"})

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

    def close(self) -> None:
        if self.session is not None:
            self.session.dispose()


__all__ = ["EX_DECLARED_DEAD", "EX_FENCED", "Fence", "FencingGuard"]
