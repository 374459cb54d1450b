"""``Fence``: why this worker's resumable executions must not run now, and stopping them.

Engaged by the fencing guard (:mod:`.fencing`) and the liveness session
(:mod:`.liveness_session`) for a named reason, released per reason. Stopping is SIGKILL of
the pool processes running resumable work (a pool without child processes, solo, threads,
gevent or eventlet, runs the task in the worker's own process: the worker then exits with
code 3).
Nothing here waits on the store or the network.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from celery.worker import state as worker_state

from celery_resilient.tasks import handed_claims
from celery_resilient.tasks.task import ResumableTask
from celery_resilient.worker.backpressure import ConsumptionGate

log = logging.getLogger(__name__)
#: Exit code of a worker that fenced a resumable execution running in its own process.
EX_FENCED = 3
#: No process id is larger (Linux's PID_MAX_LIMIT on 64-bit; other systems stay below).
PID_MAX_LIMIT = 1 << 22


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
            handed_claims.void_all()  # requests waiting for the pool take their own claims
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
            if runs_in_this_process(pid):
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


def runs_in_this_process(worker_pid: int) -> bool:
    """Whether the request Celery says ``worker_pid`` runs it runs in the worker's own
    process: solo and threads report this process's id; gevent and eventlet a green
    thread's ``id()``, a memory address no process id reaches (signalling it failed, and no
    execution was stopped); prefork a pool process's id."""
    return worker_pid == os.getpid() or worker_pid > PID_MAX_LIMIT


__all__ = ["EX_FENCED", "Fence", "runs_in_this_process"]
