"""What store calls return: plain records, never rows or SQL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Decided in core (a pure take decision), importable from here as before; the alias marks
# the re-export for type checkers.
from celery_resilient.core.take import TakeAction as TakeAction  # noqa: PLC0414

#: The error of work ended because Celery's revoke list named its task id.
REVOKE_LIST_ERROR = "revoked by task id (Celery's revoke list)"
#: A work row's checkpoint columns once it is cleared: the next save is #1 again.
NO_CHECKPOINT: dict[str, Any] = {"checkpoint_json": None, "checkpoint_seq": 0,
                                 "checkpoint_epoch": None, "checkpoint_at": None}


@dataclass(frozen=True)
class Resume:
    """What a take read of the checkpoint to resume from (``found``: None, nothing saved)."""

    found: tuple[str, int] | None


@dataclass(frozen=True)
class Receipt:
    """A delivered message of a resumable task, as the worker's main process saw it."""

    work_key: str
    task_name: str
    task_id: str
    args_digest: str | None
    message_json: str | None


@dataclass(frozen=True)
class Claim:
    work_key: str
    epoch: int
    attempts: int
    deaths: int
    #: The checkpoint to resume from as the take read it, so that the body's first ``load``
    #: costs no round trip. None: not read, ``load`` asks the store.
    resume: Resume | None = None


@dataclass(frozen=True)
class TakeOutcome:
    """What a pool process should do with a delivery.

    ``run``: execute under ``claim``; ``done``: return ``result`` without running; ``held``: a
    live execution owns it, run nothing; ``dead``: exceeded the death cap; ``duplicate``: this
    very request was ignored and is not re-run; ``failed``: this very request already failed
    (``result_json``: the failure in Celery's JSON form, if kept; ``reason``: its text);
    ``stopped``: this request was revoked, expired or cancelled (``reason`` is that state).
    """

    action: TakeAction
    claim: Claim | None = None
    result_json: str | None = None
    reason: str = ""
    #: ``held``: the incarnation holding it, when it is another worker's.
    held_by: str | None = None


@dataclass(frozen=True)
class Orphan:
    work_key: str
    task_id: str
    task_name: str
    message_json: str | None
    previous_state: str
    previous_owner: str | None
    #: The try (Celery ``retries``) that holds or last held the claim: the re-published copy
    #: is sent as that try, or the take would refuse it as a stale copy of an earlier one.
    retries: int = 0


@dataclass(frozen=True)
class Ended:
    """Work the sweep ended instead of re-publishing it (revoked, or dead)."""

    work_key: str
    task_id: str
    task_name: str
    state: str
    reason: str


#: ``Store.prove_dead``: what a probe of an incarnation's liveness lock found.
PROVEN_DEAD, SESSION_ALIVE, UNJUDGED = "proven dead", "session alive", "unjudged"
#: ``workers.ended_by``: it stopped itself; a successor on its host saw its process gone; a
#: later start of its node name found its session ended (all three stopped); another worker
#: found its session ended (not stopped: it may run on behind a partition, and clears the
#: mark when it holds its liveness lock again, after stopping its executions).
ENDED_STOP, ENDED_PROCESS, ENDED_SUCCESSOR, ENDED_SESSION = (
    "stop", "process", "successor", "session")


@dataclass(frozen=True)
class GoneIncarnations:
    """Who a sweep may take work from, and how much of it.

    ``dead``: the process is gone (it stopped, its successor saw it gone, or a later start of
    its node name found its session ended): everything it held. ``unproven``: its lease
    expired (or was ended because another worker found its session ended), but it may still
    run (a partition, a pause): only work the store fences. ``unknown``: no row names it."""

    dead: set[str]
    unproven: set[str]
    unknown: set[str]


@dataclass(frozen=True)
class IncarnationRow:
    """Another start of a worker node, as its lease row says (times on the store's clock)."""

    incarnation: str
    node: str
    pid: int
    process: str | None
    heartbeat_at: float
    lease_expires_at: float | None
    db_now: float
    #: The server start its liveness lock was taken on (None: it holds no such lock).
    liveness_server: float | None = None


@dataclass(frozen=True)
class LiveBroker:
    """The broker a live incarnation of the store recorded at its start."""

    node: str
    incarnation: str
    #: As :class:`celery_resilient.broker.identity.BrokerIdentity` dumps it.
    broker: str
    #: Seconds since it last renewed its lease (the store's clock).
    renewed_ago: float


@dataclass(frozen=True)
class WorkInfo:
    """One work row as operators and tests see it (the stored message is summarised, not shown)."""

    work_key: str
    task_name: str
    task_id: str
    state: str
    epoch: int
    owner_node: str | None
    incarnation: str | None
    owner_pid: int | None
    lease_expires_at: float | None
    attempts: int
    deaths: int
    republished: int
    has_message: bool
    result_json: str | None
    error: str | None
    created_at: float
    updated_at: float
    finished_at: float | None


def work_info(row: Any) -> WorkInfo:
    return WorkInfo(
        row.work_key, row.task_name, row.task_id, row.state, int(row.epoch), row.owner_node,
        row.incarnation, None if row.owner_pid is None else int(row.owner_pid),
        None if row.lease_expires_at is None else float(row.lease_expires_at),
        int(row.attempts), int(row.deaths), int(row.republished),
        row.message_json is not None, row.result_json, row.error, float(row.created_at),
        float(row.updated_at), None if row.finished_at is None else float(row.finished_at),
    )
