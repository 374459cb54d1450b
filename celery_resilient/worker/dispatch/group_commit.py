"""The group commit: results pool processes hand over, committed by the next statement.

A pool process that ran a claim handed by the batched takes, for a task whose result is not
stored, writes the result to a pipe (:mod:`celery_resilient.tasks.handed_results`) instead
of committing ``done`` itself. The dispatcher's thread collects them here and every statement
it makes (a batch of takes, or one of their own) carries every result not yet committed: one
statement and one WAL flush for many results, before their acknowledgements.
"""

from __future__ import annotations

import threading
import time

from celery_resilient.core import killpoints
from celery_resilient.core.identity import Owner
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.batched_takes import Finish
from celery_resilient.tasks import handed_results
from celery_resilient.worker.dispatch.log import log
from celery_resilient.worker.dispatch.parking import HandedClaim


class GroupCommit:
    """The results handed over and not committed yet, by work key."""

    def __init__(self, rt: Runtime, owner: Owner) -> None:
        self.rt = rt
        self.owner = owner
        self._reader = handed_results.Reader()
        #: Until a statement commits them (each batch carries all of them).
        self.finishes: dict[str, Finish] = {}
        #: Held from the results' collection until the statement carrying them settled them.
        self.lock = threading.Lock()
        #: When the oldest result not yet committed came in.
        self.since = 0.0
        #: Keys group-committed whose acknowledgement is still due (kill points only).
        self._committed: set[str] = set()

    def collect(self) -> None:
        """The results pool processes handed over since the last call (lock held)."""
        for finish in self._reader.drain():
            if not self.finishes:
                self.since = time.monotonic()
            self.finishes[finish.work_key] = finish

    def pending(self) -> set[str]:
        """Work keys of the results handed over and not committed yet."""
        with self.lock:
            self.collect()
            return set(self.finishes)

    def commit(self) -> bool:
        """Commit the results handed over so far in a statement of their own (no takes);
        whether it wrote (then it waited for the WAL flush). Raises if the store fails."""
        with self.lock:
            self.collect()
            if not self.finishes:
                return False
            fins = list(self.finishes.values())
            _, finished = self.rt.store.take_batch([], [], self.owner, 0.0, 0, fins)
            self.committed_now(fins, finished)
            return bool(finished)

    def committed_now(self, fins: list[Finish], finished: set[str]) -> None:
        """``fins`` were in a statement that committed (lock held): they are done, or their
        claim moved on (taken over, stopped) and the result was not recorded."""
        for finish in fins:
            if self.finishes.get(finish.work_key) is finish:
                del self.finishes[finish.work_key]
            if finish.work_key not in finished:
                log.warning("result of work %s (epoch %d) not recorded: its claim moved on "
                            "before the group commit", finish.work_key, finish.epoch,
                            extra={"action": "finish_refused", "work_key": finish.work_key})
            elif killpoints.ARMED:
                self._committed.add(finish.work_key)

    def before_ack(self, claim: HandedClaim | None) -> None:
        """Kill point ``before_ack`` of a result the main process committed (whole worker)."""
        if claim is not None and claim[0] in self._committed:
            self._committed.discard(claim[0])
            if killpoints.SCOPE != "process":
                killpoints.reached("before_ack")
