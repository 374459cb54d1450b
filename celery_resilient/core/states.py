"""The work state machine: every state a unit of work can be in, and every named transition.

This is the one place the lifecycle is defined. The store's SQL implements each transition
(guarded by its ``sources``); the task wrapper and the worker's main process map Celery's
outcomes onto them; ``docs/architecture.md`` prints :data:`TRANSITIONS` as a table, and the
stateful property test (``tests/integration/test_state_machine.py``) holds the store to it.

Terminal states are never re-published by the recovery sweep. ``done`` and ``dead`` bind the
work key: every later delivery of that key returns the stored result, or fails with
``WorkDead``. ``failed``, ``ignored``, ``revoked``, ``expired`` and ``cancelled`` bind the
*task id*, as Celery's own outcomes do: a copy of the same message runs nothing, while a new
request (a new task id) for the same work key runs again.
"""

from __future__ import annotations

from dataclasses import dataclass

RESERVED = "reserved"    # received by a worker (running or prefetched), not started
RUNNING = "running"      # taken by one execution (epoch); its writes are fenced by the epoch
REQUEUED = "requeued"    # waiting for a worker: submitted, handed back, or re-published
#: ``owner_pid`` of a ``running`` claim its worker's main process took for a request it holds
#: and has not yet seen a pool process start (store/batched_takes.py): its own worker holds
#: it live, and its takeover after that worker died counts no death.
UNSTARTED_PID = 0
DONE = "done"            # finished; its result is stored and returned to every copy
FAILED = "failed"        # the body raised (retries exhausted, time limit, Reject without requeue)
IGNORED = "ignored"      # the body raised celery.exceptions.Ignore
REVOKED = "revoked"      # revoked by id (before start, while prefetched, or terminate=True)
EXPIRED = "expired"      # its message's ``expires`` passed before it ran
CANCELLED = "cancelled"  # an operator cancelled it (running work stops at its next write)
DEAD = "dead"            # died or was re-published too often; parked with the reason

NEW = "(new)"            # not a stored state: the work has no row yet

OPEN_STATES = (RESERVED, RUNNING, REQUEUED)
#: Terminal states bound to the task id: the same message never runs again.
ENDED_BY_REQUEST = (FAILED, IGNORED, REVOKED, EXPIRED, CANCELLED)
#: Terminal states bound to the work key: no delivery of the key runs again.
ENDED_FOR_KEY = (DONE, DEAD)
TERMINAL_STATES = (*ENDED_FOR_KEY, *ENDED_BY_REQUEST)
ALL_STATES = (*OPEN_STATES, *TERMINAL_STATES)
#: What the caller's AsyncResult shows for a copy that finds the work in this state.
STOPPED_STATES = (REVOKED, EXPIRED, CANCELLED)


@dataclass(frozen=True)
class Transition:
    name: str
    sources: tuple[str, ...]  # NEW: the work has no row yet
    target: str
    who: str                  # which process makes it
    why: str


TRANSITIONS: tuple[Transition, ...] = (
    Transition("submit", (NEW,), REQUEUED, "caller (apply_async)",
               "durable submit: the message is stored before it is published"),
    Transition("receive", (NEW, RESERVED, REQUEUED), RESERVED, "worker main process",
               "a delivery (running or prefetched) is recorded with its message and a lease"),
    Transition("take", (NEW, RESERVED, REQUEUED), RUNNING, "pool process",
               "an execution starts: epoch + 1; its writes are fenced by that epoch"),
    Transition("take_over", (RUNNING,), RUNNING, "pool process",
               "the owner died (a death is counted) or the copy re-sent by the execution "
               "itself replaces it (store outage, retry: no death)"),
    Transition("restart", ENDED_BY_REQUEST, RUNNING, "pool process",
               "a new request (new task id) for a key whose earlier request ended"),
    Transition("finish", (RUNNING,), DONE, "pool process",
               "the result and done commit together, before the broker ack"),
    Transition("fail", OPEN_STATES, FAILED, "pool process (running) or main process",
               "exception, retries exhausted, soft time limit, Reject(requeue=False); the "
               "main process records a hard time limit by task id, whatever the claim's state"),
    Transition("ignore", (RUNNING,), IGNORED, "pool process",
               "the body raised Ignore, or a retry or replacement became another work key"),
    Transition("hand_back", (RUNNING,), REQUEUED, "pool process",
               "self.retry (within max_retries), Reject(requeue=True) or self.replace: the "
               "next message takes it, no death counted; copies of earlier tries never do; "
               "after self.replace only the replacement's message (it supersedes the "
               "epoch: `handed_to`, migration 0008) takes it, and the sweeper leaves it "
               "alone"),
    Transition("revoke", (NEW, *OPEN_STATES), REVOKED,
               "worker main process, or the take or sweep that meets a revoked task id",
               "revoked by id (running work only with terminate=True, or when its owner "
               "dies after the revoke)"),
    Transition("expire", (*OPEN_STATES, REVOKED), EXPIRED, "worker main process",
               "a delivery was discarded because its expires passed (Celery lists an expired "
               "id as revoked first: the expiry relabels that revoke)"),
    Transition("cancel", OPEN_STATES, CANCELLED, "operator",
               "celery resilient cancel / Django admin; running work stops at its next write"),
    Transition("orphan", OPEN_STATES, REQUEUED, "sweeper",
               "the owner incarnation is gone (stopped, proven dead, or its lease expired) "
               "or the claim has no owner: re-published with backoff; a running claim "
               "counts a death"),
    Transition("let_go", (RUNNING,), REQUEUED, "worker main process",
               "its execution ended without recording an outcome (a lost take reply, a "
               "store-outage re-send in flight): no death; the copy in flight takes it, or "
               "the sweep re-publishes it when the hold expires"),
    Transition("park", OPEN_STATES, DEAD, "pool process or sweeper",
               "deaths reached resilient_max_attempts, or re-publishes reached "
               "resilient_max_republish without progress"),
    Transition("stop", (RESERVED,), REQUEUED, "worker main process",
               "a clean shutdown hands its prefetched claims back"),
    Transition("retry", (DEAD, *ENDED_BY_REQUEST), REQUEUED, "operator",
               "celery resilient retry: the stored message is sent again, counters reset "
               "(done work is never re-run)"),
)

BY_NAME = {t.name: t for t in TRANSITIONS}


def allowed(name: str, state: str | None) -> bool:
    """Whether transition ``name`` may start from ``state`` (None: no row yet)."""
    return (NEW if state is None else state) in BY_NAME[name].sources


#: States of a beat slot record (``schedule_runs``): claimed by a beat, then sent, started by
#: a worker, or skipped by its catch-up policy.
CLAIMED, SENT, SKIPPED, STARTED = "claimed", "sent", "skipped", "started"
