"""Back-pressure: a worker stops taking messages while the store is down.

Without it, every delivery during an outage fails its take, is re-sent as a countdown message
and acknowledged; countdown messages bypass the prefetch limit, so the backlog moves from the
broker into the worker's memory. The :class:`ConsumptionGate` cancels the worker's task
queues when the maintainer thread finds the store down and consumes them again once a round
succeeds, so the backlog stays in the broker, which is built to hold it.

The maintainer thread only records what it wants; the queues are cancelled and restored on
the worker's event loop through ``Consumer.call_soon`` (kombu's hub, woken from another thread,
or the pending operations of the synchronous loop of green pools), with Celery's own
``cancel_task_queue``/``add_task_queue``, the calls behind the ``cancel_consumer`` and
``add_consumer`` remote-control commands. Cancelling also deselects the queues from
``app.amqp.queues``, so a consumer that reconnects to the broker during the pause stays
paused; the remote-control connection (pidbox) is untouched, so the worker still answers
``inspect`` and ``control``. Messages already received (prefetched, or countdown messages
waiting in the worker's timer) are not returned: they run, and a take that finds the store down
re-sends its message to the broker, where it waits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: A scheduled change not run by the event loop within this long is scheduled again (a loop
#: that was busy or restarting may have dropped it).
RESCHEDULE_AFTER = 10.0


class ConsumptionGate:
    """Pauses a worker's task consumption while the store is down; resumes when it answers.

    ``store_down`` and ``store_up`` are thread-safe and idempotent: call them after every
    maintenance round. They never touch the broker themselves; the event loop applies the
    wanted state at its next turn. :attr:`paused` is the state applied, not the one wanted.
    A worker without a consumer that can cancel its queues (a bare ``WorkController``, a
    custom consumer) keeps consuming: the gate logs that once and does nothing.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._store_down = False
        #: Set while the worker fences itself (worker.fencing): it must not take work.
        self._fenced: str | None = None
        self._reason = ""
        self._scheduled_at: float | None = None  # when a change was handed to the loop
        self._unsupported_logged = False
        # Applied state, written on the event loop only. `_cancelled`: the queues this gate
        # cancelled and has not restored (None: no pause in effect); `_paused`: all cancelled.
        self._cancelled: list[str] | None = None
        self._paused = False

    @property
    def paused(self) -> bool:
        """True while the worker's task queues are cancelled by this gate."""
        return self._paused

    @property
    def _want_paused(self) -> bool:
        return self._store_down or self._fenced is not None

    def store_down(self, reason: str) -> None:
        """The store did not answer: stop taking messages (applied on the event loop)."""
        with self._lock:
            self._store_down = True
            self._reason = " ".join(reason.split())  # one log line, whatever the driver says
        self._schedule()

    def store_up(self) -> None:
        """The store answered: consume the queues consumed before the pause again (unless
        the worker is fencing itself)."""
        with self._lock:
            self._store_down = False
        self._schedule()

    def fence(self, reason: str) -> None:
        """The worker fences itself: take no work until :meth:`unfence`."""
        with self._lock:
            self._fenced = self._reason = f"fenced: {reason}"
        self._schedule()

    def unfence(self) -> None:
        with self._lock:
            self._fenced = None
        self._schedule()

    # -- maintainer thread side ------------------------------------------------------------

    def _schedule(self) -> None:
        with self._lock:
            if not self._differs():
                return
            now = time.monotonic()
            if self._scheduled_at is not None and now - self._scheduled_at < RESCHEDULE_AFTER:
                return  # the loop has not run the last one yet
            consumer = self._consumer()
            if consumer is None:
                return
            self._scheduled_at = now
        try:
            consumer.call_soon(self._apply)
        except Exception:  # a consumer being torn down; the next round tries again
            with self._lock:
                self._scheduled_at = None
            log.exception("could not schedule a change of consumption",
                          extra={"action": "consumption_gate_error"})

    def _differs(self) -> bool:
        """Whether the wanted state is not applied (a partial pause counts as not paused)."""
        if self._want_paused:
            return not self._paused
        return self._cancelled is not None

    def _consumer(self) -> Any:
        consumer = getattr(self.worker, "consumer", None)
        if consumer is not None and all(callable(getattr(consumer, name, None)) for name in (
                "call_soon", "cancel_task_queue", "add_task_queue")):
            return consumer
        if not self._unsupported_logged:
            self._unsupported_logged = True
            log.warning("this worker's consumer cannot cancel its queues; consumption is not "
                        "paused while the store is down", extra={"action": "consumption_gate_off"})
        return None

    # -- event loop side -------------------------------------------------------------------

    def _apply(self) -> None:
        with self._lock:
            want, reason = self._want_paused, self._reason
            self._scheduled_at = None
        try:
            if want and not self._paused:
                self._pause(reason)
            elif not want and self._cancelled is not None:
                self._resume()
        except Exception:  # the broker connection is failing too; the next round tries again
            log.exception("could not %s consumption", "pause" if want else "resume",
                          extra={"action": "consumption_gate_error"})

    def _pause(self, reason: str) -> None:
        consumer = self.worker.consumer
        task_consumer = getattr(consumer, "task_consumer", None)
        if task_consumer is None:
            return  # not consuming yet (starting or reconnecting); the next round tries again
        if self._cancelled is None:
            self._cancelled = []
        for name in [q.name for q in task_consumer.queues]:
            consumer.cancel_task_queue(name)
            if name not in self._cancelled:
                self._cancelled.append(name)
        self._paused = True
        log.warning("paused consuming from %s until the store answers: %s",
                    ", ".join(self._cancelled) or "no queue", reason,
                    extra={"action": "consumption_paused", "queues": list(self._cancelled)})

    def _resume(self) -> None:
        consumer = self.worker.consumer
        if getattr(consumer, "task_consumer", None) is None:
            return  # reconnecting; the next round tries again
        queues = list(self._cancelled or ())
        self._paused = False  # from here on a failure leaves a partial pause, resumed later
        while self._cancelled:
            consumer.add_task_queue(self._cancelled[0])
            self._cancelled.pop(0)
        self._cancelled = None
        log.info("store answers again; resumed consuming from %s",
                    ", ".join(queues) or "no queue",
                    extra={"action": "consumption_resumed", "queues": queues})


__all__ = ["ConsumptionGate"]
