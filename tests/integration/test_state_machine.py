"""The store against a reference model: random interleavings of every claim transition.

A Hypothesis ``RuleBasedStateMachine`` drives :class:`~celery_resilient.store.sql.Store` the way
workers, pool processes, sweepers and callers do - receipts, durable submissions, takes,
finishes, failures, ignores, hand-backs, fenced checkpoints, heartbeats, clean stops, sweeps,
revokes and discarded deliveries - on three work keys, with two worker nodes of up to two
incarnations each, while pool processes and whole workers die. Time never passes for real:
leases are granted either far in the future or already in the past (the store uses the
database's clock), and a ``time_passes`` step moves every lease into the past.

The model predicts every stored row (a mirror), and after every step the properties the
library promises are checked on the rows themselves:

- fencing: at most one execution (the one whose epoch is the row's, while it runs) can write;
  a write with another epoch raises ``StaleClaimError`` and changes nothing;
- no unit is lost: open work is either running under a live execution, or has a stored
  message and a lease, so that the sweep re-publishes it once the lease ends;
- terminal work is never re-published and never reopens, except by a take with a *new* task
  id for ``failed/ignored/revoked/expired/cancelled``; ``done`` and ``dead`` never change;
- a take of ``done`` work returns the stored result; a take of a revoked task id never runs;
  a request is only reported (or stored) as revoked/expired/failed/ignored if it was;
- epochs only grow;
- every change of state the store makes is a transition of ``celery_resilient.states`` whose
  ``sources`` include the state it started from.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, select, update

from celery_resilient import states
from celery_resilient.errors import StaleClaimError
from celery_resilient.states import (
    DEAD,
    DONE,
    ENDED_BY_REQUEST,
    EXPIRED,
    FAILED,
    IGNORED,
    OPEN_STATES,
    REQUEUED,
    RESERVED,
    REVOKED,
    RUNNING,
    STOPPED_STATES,
    TERMINAL_STATES,
)
from celery_resilient.store.sql import Owner, Receipt, Store

KEYS = ("k0", "k1", "k2")
TASK = "proj.task"
NODES = ("n1@host", "n2@host")
INCARNATIONS_PER_NODE = 2
POOL_SIZE = 2
LIVE, LAPSED = 600.0, -10.0  # a lease that holds for the whole run, or one already over
LEASES = st.sampled_from([LIVE, LAPSED])


def tid(key: str, n: int) -> str:
    """Task ids belong to one work key (a Celery request is one message for one key)."""
    return f"{key}-t{n}"


# -- the model ----------------------------------------------------------------------------


@dataclass
class Unit:
    """What the model expects in one work row."""

    state: str
    task_id: str
    epoch: int = 0
    node: str | None = None
    inc: str | None = None
    pid: int | None = None
    lease: str | None = None  # "live", "lapsed", or None (no lease)
    attempts: int = 0
    deaths: int = 0
    republished: int = 0
    message: str | None = None
    result: str | None = None

    def view(self) -> tuple[Any, ...]:
        return (self.state, self.task_id, self.epoch, self.node, self.inc, self.pid,
                self.lease, self.attempts, self.deaths, self.republished, self.message,
                self.result)


@dataclass(frozen=True)
class Stored:
    """A work row as read from the store, with its lease judged by the database clock."""

    unit: Unit
    created_at: float
    updated_at: float
    error: str | None

    @property
    def state(self) -> str:
        return self.unit.state


@dataclass
class Incarnation:
    node: str
    name: str
    main_pid: int
    pool: list[int]
    alive: bool = True

    @property
    def main(self) -> Owner:
        return Owner(self.node, self.name, self.main_pid)


@dataclass
class Execution:
    """One run of a task body under a claim (the epoch its take returned)."""

    key: str
    epoch: int
    task_id: str
    owner: Owner
    ended: bool = False  # it recorded its outcome, stopped itself, or was refused


@dataclass
class ResentCopy:
    """A message an execution re-sent to replace itself (store outage), naming its epoch."""

    key: str
    task_id: str
    supersedes: int


def lease_of(seconds: float) -> str:
    return "live" if seconds > 0 else "lapsed"


# The named transition each operation makes, by the state it leaves the row in.
TARGETS: dict[str, dict[str, str]] = {
    "receive": {RESERVED: "receive"},
    "submit": {REQUEUED: "submit"},
    "take": {REVOKED: "revoke", DEAD: "park"},  # to running: take / take_over / restart
    "finish": {DONE: "finish"},
    "fail": {FAILED: "fail", IGNORED: "ignore"},
    "release": {REQUEUED: "hand_back"},
    "end_request": {REVOKED: "revoke", EXPIRED: "expire", FAILED: "fail"},
    "record_revocations": {REVOKED: "revoke"},
    "claim_orphans": {REQUEUED: "orphan", REVOKED: "revoke", DEAD: "park"},
    "mark_stopped": {REQUEUED: "stop"},
}


class StoreMachine(RuleBasedStateMachine):
    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.units: dict[str, Unit] = {}
        self.checkpoints: dict[str, tuple[str, int]] = {}
        self.executions: list[Execution] = []
        self.resent: list[ResentCopy] = []
        self.incarnations: dict[str, list[Incarnation]] = {n: [] for n in NODES}
        self.live_pids: set[int] = set()
        self.pids = itertools.count(1000)
        self.messages = itertools.count(1)
        self.revocations: set[str] = set()  # the store's revocations table
        # Requests that really ended this way (what a row or a take may claim about them).
        self.ended: dict[str, set[str]] = {s: set() for s in ENDED_BY_REQUEST}
        self.epochs_seen: dict[str, int] = {}
        self.max_attempts = 3
        self.max_republish: int | None = None
        self.max_hold: float | None = None
        self.transitions_seen: set[tuple[str, str]] = set()
        for node in NODES:
            self._start(node)

    # -- setup and teardown -------------------------------------------------------------

    @initialize(max_attempts=st.sampled_from([2, 3, 50]),
                max_republish=st.sampled_from([None, 1, 2]),
                max_hold=st.sampled_from([None, 900.0]))
    def configure(self, max_attempts: int, max_republish: int | None,
                  max_hold: float | None) -> None:
        """The worker settings of this run (resilient_max_attempts and friends)."""
        self.max_attempts = max_attempts
        self.max_republish = max_republish
        self.max_hold = max_hold

    def teardown(self) -> None:
        t = self.store.t
        with self.store.begin() as conn:
            for table in (t.work, t.checkpoints, t.revocations, t.workers):
                conn.execute(delete(table))

    # -- workers and processes ----------------------------------------------------------

    def _start(self, node: str) -> None:
        n = len(self.incarnations[node])
        inc = Incarnation(node, f"{node}#{n}", next(self.pids),
                          [next(self.pids) for _ in range(POOL_SIZE)])
        self.live_pids.update([inc.main_pid, *inc.pool])
        self.incarnations[node].append(inc)

    def _current(self, node: str) -> Incarnation | None:
        incs = self.incarnations[node]
        return incs[-1] if incs and incs[-1].alive else None

    def _worker(self, n: int) -> Incarnation:
        """The live incarnation of node ``n``, or of the other node if ``n`` is down."""
        for node in (NODES[n % 2], NODES[(n + 1) % 2]):
            inc = self._current(node)
            if inc is not None:
                return inc
        raise AssertionError("no worker is running")  # _can_kill keeps one alive

    def _pool_owner(self, n: int, p: int) -> Owner:
        inc = self._worker(n)
        return Owner(inc.node, inc.name, inc.pool[p % len(inc.pool)])

    def _is_live(self, node: str | None, inc: str | None, pid: int | None) -> bool:
        return pid in self.live_pids

    def _pid_alive(self, pid: int | None) -> bool:
        return pid in self.live_pids

    def _live(self, ex: Execution) -> bool:
        return not ex.ended and ex.owner.pid in self.live_pids

    def _kill_pid(self, pid: int) -> None:
        self.live_pids.discard(pid)

    # -- reading the store ----------------------------------------------------------------

    def _rows(self) -> dict[str, Stored]:
        w = self.store.t.work
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(w, self.store.dialect.now().label("db_now"))).all()
            conn.rollback()
        found = {}
        for r in rows:
            lease = None if r.lease_expires_at is None else (
                "lapsed" if r.lease_expires_at < r.db_now else "live")
            unit = Unit(r.state, r.task_id, int(r.epoch), r.owner_node, r.incarnation,
                        r.owner_pid, lease, int(r.attempts), int(r.deaths), int(r.republished),
                        r.message_json, r.result_json)
            found[r.work_key] = Stored(unit, float(r.created_at), float(r.updated_at), r.error)
        return found

    def _checkpoints(self) -> dict[str, tuple[str, int]]:
        c = self.store.t.checkpoints
        with self.store.engine.connect() as conn:
            rows = conn.execute(select(c.c.work_key, c.c.state_json, c.c.seq)).all()
            conn.rollback()
        return {r.work_key: (r.state_json, int(r.seq)) for r in rows}

    def _apply(self, op: str, fn: Callable[[], Any],
               touched: tuple[str, ...] = ()) -> tuple[dict[str, Stored], dict[str, Stored], Any]:
        """Run one store operation and hold each change of state it made to states.py."""
        before = self._rows()
        result = fn()
        after = self._rows()
        self._check_transitions(op, before, after, touched)
        return before, after, result

    def _check_transitions(self, op: str, before: dict[str, Stored], after: dict[str, Stored],
                           touched: tuple[str, ...]) -> None:
        for key in set(before) | set(after):
            b, a = before.get(key), after.get(key)
            assert a is not None, f"{op} deleted the row of {key}"
            src = None if b is None else b.state
            if b is not None:
                assert a.unit.epoch >= b.unit.epoch, f"{op}: epoch of {key} went backwards"
                if b.state in (DONE, DEAD):
                    assert (a.state, a.unit.epoch, a.unit.result) == (
                        b.state, b.unit.epoch, b.unit.result), (
                        f"{op} changed {b.state} work {key}: {b.unit} -> {a.unit}")
            changed = (b is None or b.state != a.state or b.unit.epoch != a.unit.epoch
                       or (op == "receive" and key in touched and a.state == RESERVED))
            if not changed:
                continue
            if op == "take" and a.state == RUNNING:
                name = ("take_over" if src == RUNNING
                        else "restart" if src in ENDED_BY_REQUEST else "take")
            else:
                found = TARGETS.get(op, {}).get(a.state)
                assert found is not None, (
                    f"{op} moved {key} from {src or states.NEW} to {a.state}: "
                    "no named transition makes that change")
                name = found
            if a.unit.epoch != (0 if b is None else b.unit.epoch):
                assert op == "take" and a.state == RUNNING, (
                    f"{op} changed the epoch of {key} without starting an execution")
            assert states.allowed(name, src), (
                f"{op} made transition {name!r} of {key} from {src or states.NEW} to "
                f"{a.state}, which states.py does not allow from {src or states.NEW}")
            if b is not None and b.state in TERMINAL_STATES and a.state in OPEN_STATES:
                assert (op == "take" and b.state in ENDED_BY_REQUEST and a.state == RUNNING
                        and a.unit.task_id != b.unit.task_id), (
                    f"{op} reopened {b.state} work {key} (task {b.unit.task_id}) as "
                    f"{a.state} (task {a.unit.task_id})")
            self.transitions_seen.add((name, src or states.NEW))

    def _assert_mirror(self, after: dict[str, Stored], what: str) -> None:
        expected = {k: u.view() for k, u in self.units.items()}
        actual = {k: s.unit.view() for k, s in after.items()}
        assert actual == expected, _mismatch(what, expected, actual)

    # -- deliveries ---------------------------------------------------------------------

    def _message(self, task_id: str) -> str:
        return f'{{"task_id": "{task_id}", "copy": {next(self.messages)}}}'

    @rule(deliveries=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 2)),
                              min_size=1, max_size=3),
          n=st.integers(0, 1), lease=LEASES)
    def receive(self, deliveries: list[tuple[str, int]], n: int, lease: float) -> None:
        """The worker's main process flushes a batch of receipts (running or prefetched)."""
        who = self._worker(n).main
        batch = [Receipt(k, TASK, tid(k, t), None, self._message(tid(k, t)))
                 for k, t in deliveries]
        keys = tuple(r.work_key for r in batch)
        _, after, _ = self._apply(
            "receive", lambda: self.store.record_receipts(batch, who, lease), keys)
        for r in {r.work_key: r for r in batch}.values():
            u = self.units.get(r.work_key)
            if u is None:
                self.units[r.work_key] = Unit(RESERVED, r.task_id, node=who.node,
                                              inc=who.incarnation, lease=lease_of(lease),
                                              message=r.message_json)
            elif u.state in (RESERVED, REQUEUED):
                u.state, u.task_id, u.node, u.inc, u.pid = (
                    RESERVED, r.task_id, who.node, who.incarnation, None)
                u.lease, u.message = lease_of(lease), r.message_json
            else:
                u.message = r.message_json  # kept for any later re-publish
        self._assert_mirror(after, "receive")

    @rule(key=st.sampled_from(KEYS), t=st.integers(0, 2), timeout=LEASES)
    def submit(self, key: str, t: int, timeout: float) -> None:
        """Durable submit: the caller records the message before publishing it."""
        message = self._message(tid(key, t))
        _, after, _ = self._apply("submit", lambda: self.store.record_submission(
            key, TASK, tid(key, t), None, message, timeout))
        if key not in self.units:
            self.units[key] = Unit(REQUEUED, tid(key, t), lease=lease_of(timeout),
                                   message=message)
        self._assert_mirror(after, "submit")

    # -- takes ------------------------------------------------------------------------

    def _take(self, key: str, task_id: str, who: Owner, lease: float,
              supersedes: int | None) -> None:
        message = self._message(task_id)
        expected, expected_unit = self._predict_take(key, task_id, who, lease, supersedes,
                                                     message)
        before, after, outcome = self._apply("take", lambda: self.store.take(
            key, TASK, task_id, None, who, lease, self.max_attempts, self._is_live,
            supersedes, message_if_new=lambda: message))
        b = before.get(key)
        # The promises, independent of the mirror below.
        if task_id in self.revocations:
            assert outcome.action != "run", (
                f"take of revoked task {task_id} returned run (work {key} was "
                f"{b.state if b else states.NEW}, task {b.unit.task_id if b else None})")
        if b is not None and b.state == DONE:
            assert (outcome.action, outcome.result_json) == ("done", b.unit.result), outcome
        if outcome.action == "stopped":
            assert task_id in self.ended[outcome.reason] or (
                outcome.reason == REVOKED and task_id in self.revocations), (
                f"take of {task_id} answered {outcome.reason}, but that request was not "
                f"{outcome.reason} (work {key} was {b.state if b else states.NEW} "
                f"for task {b.unit.task_id if b else None})")
        if outcome.action == "duplicate":
            assert b is not None and task_id in self.ended[b.state], outcome
        assert (outcome.action, outcome.result_json) == expected, (
            f"take of {key} by {task_id}: expected {expected}, got {outcome}")
        if outcome.action == "run":
            assert outcome.claim is not None
            assert all(ex.epoch != outcome.claim.epoch
                       for ex in self.executions if ex.key == key), (
                f"epoch {outcome.claim.epoch} of {key} was handed out twice")
            self.executions.append(Execution(key, outcome.claim.epoch, task_id, who))
        if expected_unit is not None:
            self.units[key] = expected_unit
        self._assert_mirror(after, f"take of {key} by {task_id}")

    def _predict_take(self, key: str, task_id: str, who: Owner, lease: float,
                      supersedes: int | None,
                      message: str) -> tuple[tuple[str, str | None], Unit | None]:
        u = self.units.get(key)
        revoked = task_id in self.revocations
        if u is None:
            if revoked:
                return ("stopped", None), Unit(REVOKED, task_id, 0, who.node, who.incarnation,
                                               who.pid, lease_of(lease), message=message)
            return ("run", None), Unit(RUNNING, task_id, 1, who.node, who.incarnation, who.pid,
                                       lease_of(lease), attempts=1, message=message)
        started = replace(u, state=RUNNING, epoch=u.epoch + 1, node=who.node,
                          inc=who.incarnation, pid=who.pid, lease=lease_of(lease),
                          attempts=u.attempts + 1, task_id=task_id, republished=0, result=None)
        if u.state in (RESERVED, REQUEUED) and u.deaths < self.max_attempts and not revoked:
            return ("run", None), started
        if u.state == DONE:
            return ("done", u.result), None
        if u.state == DEAD:
            return ("dead", None), None
        if u.state in ENDED_BY_REQUEST and u.task_id == task_id:
            return ("stopped" if u.state in STOPPED_STATES else "duplicate", None), None
        died = False
        if u.state == RUNNING:
            if u.epoch != supersedes and self._running_elsewhere(u, who):
                return ("held", None), None
            died = u.epoch != supersedes
        deaths = u.deaths + int(died)
        if revoked and u.state in OPEN_STATES:
            return ("stopped", None), replace(u, state=REVOKED, deaths=deaths, pid=None,
                                              lease=None)
        if deaths >= self.max_attempts:
            return ("dead", None), replace(u, state=DEAD, deaths=deaths, pid=None, lease=None)
        return ("run", None), replace(started, deaths=deaths)

    def _running_elsewhere(self, u: Unit, who: Owner) -> bool:
        if u.inc == who.incarnation:
            return self._is_live(u.node, u.inc, u.pid)
        if u.node == who.node:
            return False  # an earlier incarnation of this node: gone
        return u.lease == "live"

    @rule(key=st.sampled_from(KEYS), t=st.integers(0, 2), n=st.integers(0, 1),
          p=st.integers(0, POOL_SIZE - 1), lease=LEASES)
    def take(self, key: str, t: int, n: int, p: int, lease: float) -> None:
        """A pool process starts a delivery of ``key``."""
        self._take(key, tid(key, t), self._pool_owner(n, p), lease, None)

    @precondition(lambda self: bool(self.resent))
    @rule(i=st.integers(0, 9), n=st.integers(0, 1), p=st.integers(0, POOL_SIZE - 1),
          lease=LEASES)
    def take_resent_copy(self, i: int, n: int, p: int, lease: float) -> None:
        """A pool process starts the copy an execution re-sent to supersede itself."""
        copy = self.resent.pop(i % len(self.resent))
        self._take(copy.key, copy.task_id, self._pool_owner(n, p), lease, copy.supersedes)

    # -- what an execution does ------------------------------------------------------------

    def _running(self) -> list[Execution]:
        return [ex for ex in self.executions if not ex.ended]

    def _pick(self, i: int) -> Execution:
        running = self._running()
        return running[i % len(running)]

    def _fenced(self, ex: Execution, op: str, write: Callable[[], Any],
                then: Callable[[Unit], None]) -> Any:
        """A write on behalf of ``ex``: it lands only while ``ex`` holds the running claim."""
        if self._holds(ex):
            _, after, value = self._apply(op, write)
            then(self.units[ex.key])
            self._assert_mirror(after, f"{op} of {ex.key} at epoch {ex.epoch}")
            return value
        before, cps = self._rows(), self._checkpoints()
        with pytest.raises(StaleClaimError):
            write()
        after = self._rows()
        assert after == before, f"a refused {op} at epoch {ex.epoch} changed the store"
        assert self._checkpoints() == cps, f"a refused {op} changed a checkpoint"
        ex.ended = True  # the task body stops at a refused write
        return None

    def _holds(self, ex: Execution) -> bool:
        u = self.units.get(ex.key)
        return u is not None and u.state == RUNNING and u.epoch == ex.epoch

    @precondition(lambda self: bool(self._running()))
    @rule(i=st.integers(0, 9))
    def finish(self, i: int) -> None:
        ex = self._pick(i)
        result = f'"result of {ex.key} at epoch {ex.epoch}"'

        def done(u: Unit) -> None:
            u.state, u.result, u.pid, u.lease = DONE, result, None, None
            ex.ended = True

        self._fenced(ex, "finish", lambda: self.store.finish(ex.key, ex.epoch, result), done)

    @precondition(lambda self: bool(self._running()))
    @rule(i=st.integers(0, 9), state=st.sampled_from([FAILED, IGNORED]))
    def fail(self, i: int, state: str) -> None:
        """The body raised (``failed``) or raised Ignore (``ignored``)."""
        ex = self._pick(i)

        def ended(u: Unit) -> None:
            u.state, u.result, u.pid, u.lease = state, None, None, None
            self.ended[state].add(ex.task_id)
            ex.ended = True

        self._fenced(ex, "fail", lambda: self.store.fail(ex.key, ex.epoch, "boom", state),
                     ended)

    @precondition(lambda self: bool(self._running()))
    @rule(i=st.integers(0, 9), hold=LEASES)
    def release(self, i: int, hold: float) -> None:
        """self.retry or Reject(requeue=True): the claim is handed back."""
        ex = self._pick(i)

        def handed_back(u: Unit) -> None:
            u.state, u.node, u.inc, u.pid = REQUEUED, None, None, None
            u.lease, u.republished = lease_of(hold), 0
            ex.ended = True

        self._fenced(ex, "release", lambda: self.store.release(ex.key, ex.epoch, hold),
                     handed_back)

    @precondition(lambda self: bool(self._running()))
    @rule(i=st.integers(0, 9), row=st.integers(1, 2))
    def save_checkpoint(self, i: int, row: int) -> None:
        ex = self._pick(i)
        state_json = f'{{"row": {row}}}'

        def saved(u: Unit) -> None:
            stored = self.checkpoints.get(ex.key)
            if stored is None or stored[0] != state_json:
                u.deaths = 0  # progress: the crash-loop counter starts again
            self.checkpoints[ex.key] = (state_json, (stored[1] if stored else 0) + 1)

        seq = self._fenced(ex, "checkpoint", lambda: self.store.save_checkpoint(
            ex.key, ex.epoch, state_json), saved)
        if seq is not None:
            assert seq == self.checkpoints[ex.key][1]
            assert self._checkpoints() == self.checkpoints

    @precondition(lambda self: any(self._live(ex) and self._holds(ex)
                                   for ex in self.executions))
    @rule(i=st.integers(0, 9))
    def resend_itself(self, i: int) -> None:
        """The store is down mid-task: the execution re-sends itself naming its epoch, stops."""
        candidates = [ex for ex in self.executions if self._live(ex) and self._holds(ex)]
        ex = candidates[i % len(candidates)]
        ex.ended = True
        self.resent.append(ResentCopy(ex.key, ex.task_id, ex.epoch))

    @precondition(lambda self: any(self._live(ex) for ex in self.executions))
    @rule(i=st.integers(0, 9))
    def hard_time_limit(self, i: int) -> None:
        """The main process kills a pool process at the hard limit and ends its request."""
        candidates = [ex for ex in self.executions if self._live(ex)]
        ex = candidates[i % len(candidates)]
        self._kill_process(ex.owner)
        self._end_request(ex.task_id, FAILED)

    # -- the worker's main process ------------------------------------------------------

    def _end_request(self, task_id: str, state: str) -> None:
        _, after, changed = self._apply(
            "end_request", lambda: self.store.end_request(task_id, state, "ended"))
        n = 0
        for u in self.units.values():
            if u.task_id == task_id and u.state in OPEN_STATES:
                u.state, u.pid, u.lease = state, None, None
                n += 1
        self.ended[state].add(task_id)
        assert changed == n
        self._assert_mirror(after, f"end_request({task_id}, {state})")

    @rule(key=st.sampled_from(KEYS), t=st.integers(0, 2),
          state=st.sampled_from([REVOKED, EXPIRED]))
    def discard(self, key: str, t: int, state: str) -> None:
        """Celery discarded a delivery as revoked or expired (task_revoked)."""
        self._end_request(tid(key, t), state)

    @rule(key=st.sampled_from(KEYS), t=st.integers(0, 2), terminate=st.booleans())
    def revoke(self, key: str, t: int, terminate: bool) -> None:
        """app.control.revoke: recorded by the revoke watcher; terminate kills its process."""
        task_id = tid(key, t)
        _, after, changed = self._apply(
            "record_revocations", lambda: self.store.record_revocations([task_id]))
        self.revocations.add(task_id)
        n = 0
        for u in self.units.values():
            if u.task_id == task_id and u.state in (RESERVED, REQUEUED):
                u.state, u.pid, u.lease = REVOKED, None, None
                n += 1
        assert changed == n
        self._assert_mirror(after, f"record_revocations([{task_id}])")
        killed = [ex for ex in self.executions if ex.task_id == task_id and self._live(ex)]
        if terminate and killed:
            for ex in killed:
                self._kill_process(ex.owner)
            self._end_request(task_id, REVOKED)

    @rule(n=st.integers(0, 1), lease=LEASES)
    def heartbeat(self, n: int, lease: float) -> None:
        inc = self._worker(n)
        dead = {u.pid for u in self.units.values()
                if u.inc == inc.name and u.state == RUNNING and u.pid is not None
                and u.pid != inc.main_pid and not self._pid_alive(u.pid)}
        _, _, renewed = self._apply("heartbeat", lambda: self.store.heartbeat(
            inc.main, lease, self._pid_alive))
        if dead:
            time.sleep(0.005)  # a lease ended "now" is over by the next read (SQLite: ms clock)
        count = 0
        for u in self.units.values():
            if u.inc != inc.name or u.state not in (RESERVED, RUNNING):
                continue
            if u.state == RUNNING and u.pid in dead:
                u.lease = "lapsed"
            else:
                u.lease = lease_of(lease)
                count += 1
        assert renewed == count
        self._assert_mirror(self._rows(), "heartbeat")

    @rule(n=st.integers(0, 1), limit=st.integers(1, 3), hold=LEASES)
    def sweep(self, n: int, limit: int, hold: float) -> None:
        """The recovery sweep of a worker takes back orphans and marks them re-published."""
        inc = self._worker(n)
        candidates = {k for k, u in self.units.items() if u.state in OPEN_STATES and (
            u.lease == "lapsed" or (u.node == inc.node and u.inc is not None
                                    and u.inc != inc.name))}
        before, after, orphans = self._apply("claim_orphans", lambda: self.store.claim_orphans(
            inc.main, limit, hold, self.max_republish, self.max_hold))
        taken = {k for k in candidates
                 if after[k].state != before[k].state
                 or after[k].unit.republished != before[k].unit.republished}
        assert len(taken) == min(limit, len(candidates)), (
            f"sweep (limit {limit}) took {sorted(taken)} of orphans {sorted(candidates)}")
        if taken and taken != candidates:
            assert max(before[k].created_at for k in taken) <= min(
                before[k].created_at for k in candidates - taken), "sweep skipped older work"
        for o in orphans:
            b = before[o.work_key]
            assert b.state in OPEN_STATES, f"sweep re-published {b.state} work {o.work_key}"
            assert (o.task_id, o.message_json, o.previous_state, o.previous_owner) == (
                b.unit.task_id, b.unit.message, b.state, b.unit.node), o
            assert o.message_json is not None, f"orphan {o.work_key} cannot be re-published"
        republished = set()
        for k in sorted(taken):
            u = self.units[k]
            deaths = u.deaths + (1 if u.state == RUNNING else 0)
            if u.task_id in self.revocations:
                u.state, u.deaths, u.pid, u.lease = REVOKED, deaths, None, None
            elif self.max_republish is not None and u.republished >= self.max_republish:
                u.state, u.deaths, u.pid, u.lease = DEAD, deaths, None, None
            else:
                u.state, u.node, u.inc, u.pid = REQUEUED, None, None, None
                u.lease, u.republished, u.deaths = lease_of(hold), u.republished + 1, deaths
                republished.add(k)
        assert {o.work_key for o in orphans} == republished
        self._assert_mirror(after, "sweep")

    @rule()
    def time_passes(self) -> None:
        """Long enough that every lease granted so far is over (the database clock is used)."""
        w = self.store.t.work
        past = self.store.now() - 60
        with self.store.begin() as conn:
            conn.execute(update(w).where(w.c.lease_expires_at.is_not(None))
                         .values(lease_expires_at=past))
        for u in self.units.values():
            if u.lease is not None:
                u.lease = "lapsed"

    # -- deaths -------------------------------------------------------------------------

    def _kill_process(self, who: Owner) -> None:
        """A pool process dies (SIGKILL, OOM, hard time limit); the pool starts another."""
        self._kill_pid(who.pid)
        for incs in self.incarnations.values():
            for inc in incs:
                if who.pid in inc.pool and inc.alive:
                    fresh = next(self.pids)
                    inc.pool[inc.pool.index(who.pid)] = fresh
                    self.live_pids.add(fresh)

    @rule(n=st.integers(0, 1), p=st.integers(0, POOL_SIZE - 1))
    def kill_pool_process(self, n: int, p: int) -> None:
        self._kill_process(self._pool_owner(n, p))

    def _can_stop(self, node: str) -> bool:
        if self._current(node) is None:
            return False
        others = [x for x in NODES if x != node and self._current(x) is not None]
        return bool(others) or len(self.incarnations[node]) < INCARNATIONS_PER_NODE

    @precondition(lambda self: any(self._can_stop(node) for node in NODES))
    @rule(n=st.integers(0, 1), clean=st.booleans(), hold=LEASES)
    def worker_stops(self, n: int, clean: bool, hold: float) -> None:
        """A worker stops (clean: its prefetched claims are handed back) or is SIGKILLed;
        it is started again while it has incarnations left."""
        node = next(x for x in (NODES[n], NODES[1 - n]) if self._can_stop(x))
        inc = self._current(node)
        assert inc is not None
        if clean:
            _, after, _ = self._apply("mark_stopped",
                                      lambda: self.store.mark_stopped(inc.main, hold))
            for u in self.units.values():
                if u.inc == inc.name and u.state == RESERVED:
                    u.state, u.node, u.inc, u.lease = REQUEUED, None, None, lease_of(hold)
            self._assert_mirror(after, "mark_stopped")
        inc.alive = False
        for pid in (inc.main_pid, *inc.pool):
            self._kill_pid(pid)
        if len(self.incarnations[node]) < INCARNATIONS_PER_NODE:
            self._start(node)

    # -- properties -------------------------------------------------------------------------

    @invariant()
    def mirror_holds(self) -> None:
        self._assert_mirror(self._rows(), "the last step")

    @invariant()
    def epochs_only_grow(self) -> None:
        for key, s in self._rows().items():
            assert s.unit.epoch >= self.epochs_seen.get(key, 0), f"epoch of {key} went back"
            self.epochs_seen[key] = s.unit.epoch

    @invariant()
    def one_writer_per_key(self) -> None:
        """Only the execution at the row's epoch, while it runs, may write; it is the owner."""
        rows = self._rows()
        for key, s in rows.items():
            writers = [ex for ex in self.executions
                       if ex.key == key and s.state == RUNNING and ex.epoch == s.unit.epoch]
            assert len(writers) <= 1, f"{key}: {writers}"
            if s.state == RUNNING:
                assert writers, f"{key} is running at epoch {s.unit.epoch} that no take gave"
                w = writers[0]
                assert (w.owner.node, w.owner.incarnation, w.owner.pid) == (
                    s.unit.node, s.unit.inc, s.unit.pid), (key, w, s.unit)
        for ex in self._running():
            holds = ex.key in rows and rows[ex.key].state == RUNNING and \
                rows[ex.key].unit.epoch == ex.epoch
            if holds:
                self.store.assert_current(ex.key, ex.epoch)
            else:
                with pytest.raises(StaleClaimError):
                    self.store.assert_current(ex.key, ex.epoch)

    @invariant()
    def no_unit_is_lost(self) -> None:
        for key, s in self._rows().items():
            u = s.unit
            if u.state in TERMINAL_STATES:
                continue
            assert u.message is not None, f"open work {key} has no message to re-publish"
            assert u.lease is not None, f"open work {key} has no lease: never an orphan"
            if u.state != RUNNING:
                continue
            ex = next(ex for ex in self.executions if ex.key == key and ex.epoch == u.epoch)
            inc = next(i for i in self.incarnations[u.node or ""] if i.name == u.inc)
            covered = (self._live(ex) or u.pid not in self.live_pids or not inc.alive
                       or any(c.key == key and c.supersedes == u.epoch for c in self.resent))
            assert covered, (
                f"{key} runs at epoch {u.epoch} under {ex}, which ended, while its process "
                "lives on: nothing will take it over")

    @invariant()
    def ended_requests_are_bound_to_their_task_id(self) -> None:
        for key, s in self._rows().items():
            if s.state in ENDED_BY_REQUEST:
                tid_ = s.unit.task_id
                assert tid_ in self.ended[s.state] or (
                    s.state == REVOKED and tid_ in self.revocations), (
                    f"{key} is {s.state} for task {tid_}, but that request was never "
                    f"{s.state}: a copy of it would now be refused")


def _mismatch(what: str, expected: dict[str, tuple[Any, ...]],
              actual: dict[str, tuple[Any, ...]]) -> str:
    lines = [f"store and model disagree after {what}:"]
    for key in sorted(set(expected) | set(actual)):
        e, a = expected.get(key), actual.get(key)
        if e != a:
            lines.append(f"  {key}: model {e}")
            lines.append(f"  {key}: store {a}")
    return "\n".join(lines)


SETTINGS = settings(max_examples=50, stateful_step_count=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.filter_too_much])


def test_store_follows_the_state_machine(store: Store) -> None:
    run_state_machine_as_test(lambda: StoreMachine(store), settings=SETTINGS)
