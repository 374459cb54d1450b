"""ResumableTask: lifecycle glue between Celery's task protocol and the durable store.

No SQL lives here. A delivery is claimed (epoch + 1) before the body runs; the body's
checkpoints, steps and ledger writes are fenced by that epoch; the result and the ``done``
state commit together before Celery acknowledges the message.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime
from typing import Any, TypeVar

from celery import Task
from celery.exceptions import Ignore
from celery.utils import uuid

from celery_resilient import signals
from celery_resilient.core import codec, handoff, identity, messages, workkey
from celery_resilient.core.states import IGNORED
from celery_resilient.errors import (
    NotRunning,
    ResilientError,
    StoreUnavailable,
    WorkDead,
)
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.records import Claim, TakeAction, TakeOutcome
from celery_resilient.tasks import canvas, handed_claims, handed_results, replay, result_backend
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.claimed import ClaimedRun, resend_while_store_down
from celery_resilient.tasks.context import Context, task_context
from celery_resilient.tasks.execution import Execution
from celery_resilient.tasks.headers import (
    SCHEDULED_FOR_HEADER,
    SUPERSEDES_HEADER,
    as_int,
    header,
    headers_of,
)
from celery_resilient.tasks.ledger import Ledger
from celery_resilient.tasks.steps import run_step

log = logging.getLogger(__name__)
R = TypeVar("R")
_direct_execution: ContextVar[Execution | None] = ContextVar("resilient_direct", default=None)
#: The headers other layers import from here (beat, the dispatcher), defined in .headers
__all__ = ["SCHEDULED_FOR_HEADER", "SUPERSEDES_HEADER", "ResumableTask"]


class ResumableTask(Task):  # type: ignore[misc]
    """Base class for tasks that survive any restart, ``kill -9`` included.

    Sets ``acks_late`` and ``reject_on_worker_lost`` so the broker keeps the message until
    the work is recorded done; everything else is in the store.
    """

    acks_late = True
    reject_on_worker_lost = True
    #: The main process's request: records a hard time limit as the task's failure, and
    #: releases the message from the worker's held requests when it is acked or rejected.
    Request = "celery_resilient.tasks.request:ResumableRequest"
    #: Celery's default strategy, with requests that run now taken in batches by the
    #: worker's main process before the pool runs them.
    Strategy = "celery_resilient.tasks.strategy:resumable"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A ``__call__`` of a subclass or mixin (Flask's ``FlaskTask`` pattern: the body run
        inside an app context) runs under the claim: the claim is taken around it."""
        super().__init_subclass__(**kwargs)
        outer = _foreign_call(cls)
        if outer is not None:
            cls.__call__ = _claim_around(outer)  # type: ignore[method-assign]

    # -- hooks users may override ---------------------------------------------------------

    def derive_work_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Return a logical work key for these arguments, or None to use the task id.

        Override to make two messages for the same work (a double send, a retried request)
        run once: for example ``return f"invoice:{args[0]}"``.
        """
        return None

    def on_resume(self, attempt: int) -> None:
        """Called before the body when this work ran before and did not finish."""

    # -- what task bodies use --------------------------------------------------------------

    @property
    def resilient(self) -> Runtime:
        return Runtime.of(self.app)

    @property
    def execution(self) -> Execution:
        x: Execution | None = getattr(self.request, "resilient_execution", None)
        if x is None and self.request.called_directly:
            x = _direct_execution.get()
        if x is None:
            raise NotRunning(
                f"{self.name}: checkpoints, steps and the work key exist only while the task "
                "runs (under a worker, apply(), or a direct call task(...); task.run(...) "
                "bypasses them)"
            )
        return x

    @property
    def work_key(self) -> str:
        return self.execution.work_key

    @property
    def fencing_token(self) -> int:
        """The claim's epoch: grows with every takeover; hand it to systems that can fence."""
        return self.execution.epoch

    @property
    def attempt(self) -> int:
        """How many times this work has been taken (1 for the first run); a value a task
        sets on itself (Celery's own test tasks do) is kept instead."""
        mine = self.__dict__.get("_attempt_set")
        return int(mine) if mine is not None else self.execution.attempts

    @attempt.setter
    def attempt(self, value: int) -> None:
        self.__dict__["_attempt_set"] = value

    @attempt.deleter
    def attempt(self) -> None:
        self.__dict__.pop("_attempt_set", None)

    @property
    def checkpoint(self) -> Checkpoint:
        handle: Checkpoint | None = getattr(self.request, "resilient_checkpoint", None)
        if handle is None:
            handle = Checkpoint(self.execution, self._publish_progress)
            self.request.resilient_checkpoint = handle
        return handle

    @property
    def ledger(self) -> Ledger:
        """Once-per-key effects. Keys are global, so a direct call uses the real store too
        (unfenced: it holds no claim)."""
        x = self.execution
        if x.store is None:
            return Ledger(self.resilient.store)
        return Ledger(x.store, x)

    def context(self, key: str, create_default: dict[str, Any] | None = None) -> Context:
        """The stored continuity context ``key`` (dict-like, ``.version``, ``.save()``).

        A missing context raises ``ContextNotFound`` unless ``create_default`` is given, which
        creates it explicitly. Saves are fenced by this execution's claim (a superseded run
        gets ``StaleClaimError``) and compare-and-set on the version (``ContextConflict``).
        """
        return task_context(self, key, create_default)

    def _publish_progress(self, done: int, total: int) -> None:
        """``checkpoint.save(..., progress=(done, total))``: the ``PROGRESS`` state, if stored."""
        if self.request.called_directly or not result_backend.stores_results(self):
            return
        try:
            self.update_state(state="PROGRESS", meta={"done": done, "total": total})
        except Exception as exc:  # progress is a display: never fail the work for it
            log.warning("progress of %s not published: %s", self.request.id, exc,
                        extra={"action": "progress_failed", "task_id": self.request.id})

    def step(self, name: str, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return run_step(self.execution, name, fn, *args, **kwargs)

    @property
    def scheduled_for(self) -> datetime | None:
        """The beat slot this run serves (aware datetime), or None if it was not scheduled."""
        value = header(self.request, SCHEDULED_FOR_HEADER)
        return datetime.fromisoformat(value) if isinstance(value, str) else None

    # -- lifecycle --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.request, "resilient_execution", None) is not None:
            return self.run(*args, **kwargs)  # a subclass's __call__ calling super() (claimed)
        return self._claim_and_run(None, args, kwargs)

    def _claim_and_run(self, body: Callable[..., Any] | None, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """Take the claim, run ``body`` (None: ``self.run``) under it, record the outcome."""
        req = self.request
        if req.called_directly or not req.id:
            return self._call_directly(args, kwargs, body)
        rt = self.resilient
        canvas.pin_link_ids(req)
        work_key = self._work_key_for(req.id, args, kwargs)
        who = identity.owner(req.hostname, eager=bool(req.is_eager))
        ctx = {"work_key": work_key, "task_id": req.id, "task": self.name}
        generation = handed_claims.generation()
        claim = handed_claims.received(req, who.incarnation, work_key)  # taken by the main process
        handed_claim = claim is not None
        if claim is None:
            taken = self._take(rt, req, work_key, who, ctx, args, kwargs)
            if isinstance(taken, TakeOutcome):  # a copy of ended work
                return self._ended_copy(taken, ctx)
            claim = taken
        run = ClaimedRun(self, rt, claim.epoch, ctx)
        if claim.attempts > 1 and run.end_as_told(claim):
            raise Ignore()
        if handoff.requested() and not req.is_eager:
            # Taken on a worker that is shutting down warm: hand it on before the body runs.
            run.hand_off()
            raise Ignore()
        req.resilient_execution = Execution(rt.store, rt.config, work_key, claim.epoch,
                                            claim.attempts, can_hand_off=not req.is_eager,
                                            task_id=req.id, resume_from=claim.resume,
                                            handed=handed_claim,
                                            handed_generation=generation if handed_claim
                                            else None)
        req.resilient_checkpoint = None
        identity.enter(work_key)
        try:
            return run.run(args, kwargs, body)
        finally:
            identity.leave(work_key)
            req.resilient_execution = None

    def _take(self, rt: Runtime, req: Any, work_key: str, who: identity.Owner,
              ctx: dict[str, Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Claim | TakeOutcome:
        """The pool process's own take (the careful path): the claim, or the outcome of a
        copy of ended work (done, failed); whatever else must not run raises."""
        try:
            outcome = rt.store.take(
                work_key, self.name, req.id, codec.args_digest(args, kwargs), who,
                rt.config.lease_seconds, rt.config.max_attempts,
                is_live=_is_live_here(work_key, who.pid),
                supersedes=as_int(header(req, SUPERSEDES_HEADER)),
                message_if_new=lambda: messages.from_signature(
                    self.signature_from_request(req, args, kwargs)),
                retries=int(req.retries or 0),
            )
        except StoreUnavailable as exc:
            resend_while_store_down(self, exc, None)
        if outcome.action in (TakeAction.DONE, TakeAction.FAILED):
            return outcome
        if outcome.action in (TakeAction.HELD, TakeAction.DUPLICATE):
            log.info("work %s not run: %s", work_key, outcome.reason,
                     extra={"action": "duplicate_skipped", **ctx})
            signals.send(signals.duplicate_skipped, self.app, self.name,
                         reason=outcome.reason, **ctx)
            raise Ignore()
        if outcome.action == TakeAction.STOPPED:
            log.info("work %s not run: request %s was %s", work_key, req.id, outcome.reason,
                     extra={"action": "stopped_skipped", **ctx})
            result_backend.report_revoked(self, outcome.reason)
            raise Ignore()
        if outcome.action == TakeAction.DEAD:
            log.error("work %s is dead: %s", work_key, outcome.reason,
                      extra={"action": "dead", **ctx})
            signals.send(signals.work_dead, self.app, self.name, reason=outcome.reason, **ctx)
            raise WorkDead(f"work {work_key!r} is dead: {outcome.reason}")
        assert outcome.claim is not None
        return outcome.claim

    def _call_directly(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       body: Callable[..., Any] | None = None) -> Any:
        """``task(...)`` as in Celery: the body runs now, in this process, once.

        No claim: checkpoints start empty and steps run, both kept in memory for this call
        only; nothing is resumed, fenced or recorded as work. The ledger still applies.
        """
        rt = Runtime.enabled_on(self.app)
        config = rt.config if rt is not None else ResilientConfig()
        key = self._work_key_for(f"direct-{uuid()}", args, kwargs)
        token = _direct_execution.set(Execution.for_direct_call(config, key))
        try:
            if body is not None:
                return body(*args, **kwargs)
            return super().__call__(*args, **kwargs)
        finally:
            _direct_execution.reset(token)

    def _ended_copy(self, outcome: TakeOutcome, ctx: dict[str, Any]) -> Any:
        """A copy of a request that ended (done or failed): whatever Celery was not told."""
        work_key, done = ctx["work_key"], outcome.action == TakeAction.DONE
        signals.send(signals.duplicate_skipped, self.app, self.name, reason=outcome.action,
                     **ctx)
        result = (codec.decode(outcome.result_json) if done
                  else result_backend.stored_failure(self, outcome.result_json,
                                                     outcome.reason))
        state = "SUCCESS" if done else "FAILURE"
        if result_backend.already_reported(self, state):
            # Celery sends a success's chain link and callbacks before it stores SUCCESS,
            # so a copy must not send them again; what may be left undone after the state
            # (the chord part; a failure's chain and errbacks) is made again.
            log.info("work %s already %s and reported; copy acknowledged", work_key,
                     outcome.action, extra={"action": "duplicate_skipped", **ctx})
            replay.report_again(self.backend, self.request, state, result,
                                wait_for_dispatch=not self.request.is_eager)
            raise Ignore()
        if done:
            log.info("work %s already done; returning its stored result", work_key,
                     extra={"action": "duplicate_skipped", **ctx})
            return result
        # Failed in the store, but Celery was never told (the worker died in between):
        # tell it now, as the first run would have: FAILURE, errbacks, the chord part.
        log.warning("work %s failed before its worker died; replaying the failure to "
                    "Celery without running the body", work_key,
                    extra={"action": "failure_replayed", **ctx})
        raise result

    def retry(self, args: Any = None, kwargs: Any = None, *more: Any, **options: Any) -> Any:
        """Celery's retry; the retried message may take over this execution's claim.

        Celery decides (max_retries) and publishes; the message carries this epoch as the
        one it supersedes, so it takes the claim without counting a death even if it
        arrives before the claim is handed back. Past max_retries nothing is handed back:
        the exception ends the work as ``failed``, as in Celery. A retry with arguments that
        derive another work key is another unit: this one ends ``ignored``.
        """
        req = self.request
        x: Execution | None = getattr(req, "resilient_execution", None)
        if x is not None and not req.called_directly:
            given = options.get("headers") or {}
            headers = {**(req.headers or {}), **given, SUPERSEDES_HEADER: x.epoch}
            options["headers"] = headers
            try:
                req.resilient_retry_key = workkey.derive(
                    self, req.id, req.args if args is None else args,
                    req.kwargs if kwargs is None else kwargs, headers)
            except ResilientError:
                req.resilient_retry_key = None
        return super().retry(args, kwargs, *more, **options)

    def on_replace(self, sig: Any) -> Any:
        """Celery's replace: the replacement continues this work key when it derives it
        (the default: it gets this task id), starting without this body's checkpoint;
        otherwise this unit ends ``ignored`` and the replacement is work of its own.

        The claim is handed to the replacement alone (its message supersedes this epoch):
        a copy of this request, delivered twice or re-published, is a duplicate, and the
        sweeper leaves the claim to the replacement however long Celery takes to send it
        (a chord's body waits for its headers). The store is told after Celery sent the
        replacement: a kill in between leaves this request to run again, as on Celery.
        """
        req = self.request
        x: Execution | None = getattr(req, "resilient_execution", None)
        if x is None or req.called_directly:
            return super().on_replace(sig)
        req.resilient_replaced = True
        carrier = canvas.carrying_id(sig, req.id)
        continues = carrier is not None and _replacement_key(self.app, sig, req.id) == x.work_key
        if continues and carrier is not None:
            carrier.options["headers"] = {**(carrier.options.get("headers") or {}),
                                          SUPERSEDES_HEADER: x.epoch}
        try:
            out = super().on_replace(sig)
        except Ignore:
            self._replaced(x, continues)
            raise
        self._replaced(x, continues)
        return out

    def _replaced(self, x: Execution, continues: bool) -> None:
        ctx = {"work_key": x.work_key, "task_id": self.request.id, "task": self.name}
        run = ClaimedRun(self, self.resilient, x.epoch, ctx)
        if continues:
            run.hand_back(0.0, 0, clear_checkpoint=True, replaced=True)
        else:
            run.end(Ignore("replaced by a new task"), IGNORED)

    def _work_key_for(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return workkey.derive(self, task_id, args, kwargs, headers_of(self.request))


_CLAIMING: set[Callable[..., Any]] = set()  # the __call__ wrappers made by _claim_around


def _foreign_call(cls: type) -> Callable[..., Any] | None:
    """The ``__call__`` of ``cls``'s MRO that the claim does not wrap yet, if any.

    Found before ``ResumableTask`` (``class T(FlaskTask, ResumableTask)``, or a subclass's
    own) or after it (``class T(ResumableTask, FlaskTask)``); Celery's own ends the search.
    """
    for klass in cls.__mro__:
        if klass is Task:
            return None
        call = vars(klass).get("__call__")
        if call is None or klass is ResumableTask:
            continue
        return None if call in _CLAIMING else call
    return None


def _claim_around(call: Callable[..., Any]) -> Callable[..., Any]:
    """A ``__call__`` that takes the claim, then runs ``call`` (which runs ``self.run``)."""

    @functools.wraps(call)
    def claimed_call(self: ResumableTask, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.request, "resilient_execution", None) is not None:
            return call(self, *args, **kwargs)  # a subclass's claimed __call__ via super()
        return self._claim_and_run(functools.partial(call, self), args, kwargs)

    _CLAIMING.add(claimed_call)
    return claimed_call


def _replacement_key(app: Any, sig: Any, task_id: str) -> str | None:
    """The work key the replacement's signature frozen with ``task_id`` derives, if that
    signature is a resumable task."""
    s = canvas.carrying_id(sig, task_id)
    if s is None:
        return None
    task = app.tasks.get(s.task)
    if not isinstance(task, ResumableTask):
        return None
    try:
        return workkey.derive(task, task_id, s.args, s.kwargs, (s.options or {}).get("headers"))
    except ResilientError:
        return None


def _is_live_here(work_key: str, my_pid: int) -> Callable[
        [str | None, str | None, int | None], bool]:
    """Liveness of an execution recorded by this worker incarnation (same host)."""

    def is_live(node: str | None, incarnation: str | None, pid: int | None) -> bool:
        if pid == my_pid:  # running here, or ended here with its result not yet committed
            return identity.executing_here(work_key) or handed_results.handed_here(work_key)
        return identity.pid_alive(pid)

    return is_live
