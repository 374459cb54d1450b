"""Batched takes: the worker's main process claims deliveries before the pool runs them.

Celery hands each request that is to run now to the pool from its event loop
(``consumer.on_task_request``). For a resumable task it comes here instead
(:mod:`celery_resilient.tasks.strategy`): a thread of its own takes the claims of every
request waiting, in one statement (:meth:`~celery_resilient.store.sql.Store.take_batch`),
and the event loop then hands each request on with its claim in the request dict
(:mod:`celery_resilient.tasks.handed_claims`). Requests are taken as they arrive, prefetched
ones too, so a pool process that frees up starts the next body at once, with no round trip
of its own; while one batch commits, the next gathers.

The same statement marks claims started when the pool accepted their request (the pool
process's PID becomes the claim's ``owner_pid``), and clears the owner of a claim whose pool
process died running it (the next take counts the death). A claim taken here and never
marked was never known to start: a takeover after this worker died counts no death for it.

The pool process finishes a handed claim without waiting for the WAL flush (PostgreSQL), and
its acknowledgement waits here instead, for a commit of this thread's that does wait (the
next batch of takes, or a bare flush): one flush for many results, each durable before its
ack all the same. A worker SIGKILLed in between leaves the message unacknowledged (the copy
finds the work done); only a database crash can lose such a finish, and then the claim is
still open and is re-published from the store (docs/reliability.md).

A batch that fails (store unreachable, any error) goes on without claims: each pool process
then takes its own on the careful path, with its store-outage handling. When the consumer
loses its broker connection Celery drops the requests it had not handed to the pool; so does
this dispatcher, and the claims it took for them go back to ``requeued`` (no death), for the
copies the broker delivers again.

Only prefork pools on Celery's event loop get this; other pools keep the take in the task.

:class:`BatchedDispatch` (:mod:`.dispatcher`) coordinates one part per job on Celery's
event loop and its own thread (:mod:`.takes_thread`: when that thread makes which
statement): :mod:`.taker` (a batch's one statement, each request handed on with its claim),
:mod:`.parking` (which request holds which work key unstarted, and which wait behind it),
:mod:`.marks` (started and lost marks waiting for a statement), :mod:`.group_commit`
(results pool processes hand over, committed by the next statement), :mod:`.acks`
(acknowledgements waiting for a commit that flushed, and the bare flushes for them);
:mod:`.entries` (a waiting request) and :mod:`.log` (the one logger) serve them.
"""

from __future__ import annotations

from celery_resilient.worker.dispatch.dispatcher import BatchedDispatch

__all__ = ["BatchedDispatch"]
