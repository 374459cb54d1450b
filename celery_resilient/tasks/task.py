"""ResumableTask: lifecycle glue between Celery's task protocol and the durable store.

No SQL lives here. A delivery is claimed (epoch + 1) before the body runs; the body's
checkpoints, steps and ledger writes are fenced by that epoch; the result and the ``done``
state commit together before Celery acknowledges the message.
"""

from __future__ import annotations

import functools
import logging
import uuid as uuid_module
from collections.abc import Callable
from contextvars import ContextVar
from datetime import datetime
from typing import Any, TypeVar

from celery import Task, states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry
from celery.result import ResultBase
from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from celery_resilient import signals
from celery_resilient.core import codec, handoff, identity, killpoints, messages, workkey
from celery_resilient.core.states import FAILED, IGNORED, REVOKED
from celery_resilient.errors import (
    NotRunning,
    ResilientError,
    StaleClaimError,
    StoreUnavailable,
    WorkDead,
    WorkStopped,
)
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.sql import Claim, TakeOutcome
from celery_resilient.tasks import finishes, handed, replay
from celery_resilient.tasks.checkpoint import Checkpoint
from celery_resilient.tasks.context import Context, task_context
from celery_resilient.tasks.execution import Execution
from celery_resilient.tasks.ledger import Ledger
from celery_resilient.tasks.steps import run_step

log = logging.getLogger(__name__)
R = TypeVar("R")
_direct_execution: ContextVar[Execution | None] = ContextVar("resilient_direct", default=None)
SUPERSEDES_HEADER = "resilient_supersedes"
SCHEDULED_FOR_HEADER = "resilient_scheduled_for"


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
        if self.request.called_directly or not self._stores_results():
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
        value = _header(self.request, SCHEDULED_FOR_HEADER)
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
        _pin_link_ids(req)
        work_key = self._work_key_for(req.id, args, kwargs)
        who = identity.owner(req.hostname, eager=bool(req.is_eager))
        ctx = {"work_key": work_key, "task_id": req.id, "task": self.name}
        generation = handed.generation()
        claim = handed.received(req, who.incarnation, work_key)  # taken by the main process
        handed_claim = claim is not None
        if claim is None:
            taken = self._take(rt, req, work_key, who, ctx, args, kwargs)
            if isinstance(taken, TakeOutcome):  # a copy of ended work
                return self._ended_copy(taken, ctx)
            claim = taken
        if claim.attempts > 1 and self._ended_for_the_caller(rt, claim, ctx):
            raise Ignore()
        if handoff.requested() and not req.is_eager:
            # Taken on a worker that is shutting down warm: hand it on before the body runs.
            self._hand_off(rt, claim.epoch, ctx)
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
            return self._run_claimed(rt, claim.epoch, ctx, args, kwargs, body)
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
                supersedes=_as_int(_header(req, SUPERSEDES_HEADER)),
                message_if_new=lambda: messages.from_signature(
                    self.signature_from_request(req, args, kwargs)),
                retries=int(req.retries or 0),
            )
        except StoreUnavailable as exc:
            self._retry_store_down(exc, None)
        if outcome.action in ("done", "failed"):
            return outcome
        if outcome.action in ("held", "duplicate"):
            log.info("work %s not run: %s", work_key, outcome.reason,
                     extra={"action": "duplicate_skipped", **ctx})
            signals.send(signals.duplicate_skipped, self.app, self.name,
                         reason=outcome.reason, **ctx)
            raise Ignore()
        if outcome.action == "stopped":
            log.info("work %s not run: request %s was %s", work_key, req.id, outcome.reason,
                     extra={"action": "stopped_skipped", **ctx})
            self._report_revoked(outcome.reason)
            raise Ignore()
        if outcome.action == "dead":
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

    def _run_claimed(self, rt: Runtime, epoch: int, ctx: dict[str, Any],
                     args: tuple[Any, ...], kwargs: dict[str, Any],
                     body: Callable[..., Any] | None = None) -> Any:
        """Run the body under the claim and end the claim by what Celery will do next."""
        work_key = ctx["work_key"]
        try:
            if self.execution.attempts > 1:
                log.info("resuming work %s (attempt %d)", work_key, self.execution.attempts,
                         extra={"action": "resumed", **ctx})
                self.on_resume(self.execution.attempts)
            result = (self.run if body is None else body)(*args, **kwargs)
            result_json = codec.encode(_as_stored(result), f"result of {self.name}")
            handed_over = self._hand_finish(work_key, epoch, result_json)
            if not handed_over:
                rt.store.finish(work_key, epoch, result_json, flushed=not self.execution.handed)
            if killpoints.ARMED:
                if handed_over:
                    killpoints.reached("after_finish_handed")
                if not handed_over or killpoints.SCOPE == "process":
                    killpoints.reached("before_ack")  # else in the main process, once committed
            return result
        except Retry as retry:
            # Celery published the retry (within max_retries): hand the claim to it, unless
            # new arguments make the retry another unit of work.
            req = self.request
            next_key = getattr(req, "resilient_retry_key", None) or work_key
            if next_key != work_key:
                self._record_end(rt, epoch, ctx, Ignore(f"retried as work {next_key!r}"),
                                 IGNORED)
            else:
                self._hand_back(rt, epoch, ctx, _seconds_until(retry.when),
                                int(req.retries or 0) + 1)
            raise
        except Reject as reject:
            if reject.requeue:
                self._hand_back(rt, epoch, ctx, 0.0, int(self.request.retries or 0))
            else:
                self._record_end(rt, epoch, ctx, reject, FAILED)
            raise
        except handoff.HandOff:
            self._hand_off(rt, epoch, ctx)
            raise Ignore() from None
        except WorkStopped as exc:
            log.warning("stopped: %s", exc, extra={"action": "stopped", **ctx})
            self._report_revoked(str(exc))
            raise Ignore() from exc
        except StaleClaimError as exc:
            self._fenced(epoch, ctx, str(exc))
            raise Ignore() from exc
        except StoreUnavailable as exc:
            self._retry_store_down(exc, epoch)
        except Ignore as ignore:
            if not getattr(self.request, "resilient_replaced", False):
                self._record_end(rt, epoch, ctx, ignore, IGNORED)
            raise
        except Exception as exc:
            self._record_end(rt, epoch, ctx, exc, FAILED)
            raise

    def _hand_finish(self, work_key: str, epoch: int, result_json: str) -> bool:
        """Hand the result to the main process's group commit (``tasks/finishes.py``): only
        a claim it handed and surely still this worker's, for a request whose result nobody
        is told (no result stored: the store's ``done`` still comes before any SUCCESS a
        caller can read) and with no canvas."""
        x = self.execution
        return (x.handed and handed.still_own(x.handed_generation)
                and not self._stores_results() and not _has_canvas(self.request)
                and finishes.hand(work_key, epoch, result_json))

    def _hand_back(self, rt: Runtime, epoch: int, ctx: dict[str, Any],
                   delay: float, next_retries: int, clear_checkpoint: bool = False,
                   replaced: bool = False) -> None:
        """The claim goes back to ``requeued``: the re-sent message takes it, no death."""
        try:
            rt.store.release(ctx["work_key"], epoch, delay + rt.config.submit_timeout,
                             next_retries, clear_checkpoint, replaced)
        except StaleClaimError:
            pass  # the re-sent copy (marked as superseding this epoch) already took it over
        except StoreUnavailable as exc:
            log.warning("could not hand %s back (%s); the re-sent copy takes it over",
                        ctx["work_key"], exc, extra={"action": "store_retry", **ctx})

    def _hand_off(self, rt: Runtime, epoch: int, ctx: dict[str, Any]) -> None:
        """Warm shutdown: the claim goes back with its checkpoint and the message is
        re-published now, so another worker resumes the work at once.

        If the store cannot take the claim back, the broker keeps the message (requeued)
        and the claim is an orphan as soon as this incarnation is marked stopped. If the
        re-publish fails, the sweeper sends the stored message when the hold expires.
        """
        work_key = ctx["work_key"]
        retries = int(self.request.retries or 0)
        try:
            message = rt.store.get_message(work_key)
            rt.store.release(work_key, epoch, rt.config.submit_timeout, retries)
        except StaleClaimError:
            return  # another execution took it over meanwhile: nothing to hand
        except StoreUnavailable as exc:
            log.warning("hand-off of %s failed (%s); the broker keeps its message", work_key,
                        exc, extra={"action": "hand_off_failed", **ctx})
            raise Reject(str(exc), requeue=True) from None
        sent = False
        if message is not None:
            try:
                with self.app.connection_for_write() as conn:
                    messages.publish(conn, message, {messages.REPUBLISHED_HEADER: 1}, self.app,
                                     retries=retries, started=True)
                sent = True
            except Exception as exc:
                log.warning("hand-off of %s: re-publish failed (%s); the sweeper sends it "
                            "after %.0fs", work_key, exc, rt.config.submit_timeout,
                            extra={"action": "hand_off_failed", **ctx})
        log.info("handed off work %s at epoch %d (warm shutdown)%s", work_key, epoch,
                 "" if sent else "; not re-published yet", extra={"action": "handed_off", **ctx})
        signals.send(signals.work_handed_off, self.app, self.name, epoch=epoch,
                     republished=sent, **ctx)

    def _ended_copy(self, outcome: TakeOutcome, ctx: dict[str, Any]) -> Any:
        """A copy of a request that ended (done or failed): whatever Celery was not told."""
        work_key, done = ctx["work_key"], outcome.action == "done"
        signals.send(signals.duplicate_skipped, self.app, self.name, reason=outcome.action,
                     **ctx)
        result = (codec.decode(outcome.result_json) if done
                  else self._stored_failure(outcome.result_json, outcome.reason))
        state = "SUCCESS" if done else "FAILURE"
        if self._already_reported(state):
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

    def _stored_failure(self, failure_json: str | None, reason: str) -> BaseException:
        """The exception a failed request ended with, rebuilt from the store."""
        if failure_json:
            try:
                exc = self.backend.exception_to_python(codec.decode(failure_json))
                if isinstance(exc, BaseException):
                    return exc
            except Exception as err:  # an exception type not importable here
                log.warning("stored failure of %s not rebuilt (%s)", self.request.id, err)
        return ResilientError(f"this request already failed: {reason}")

    def _record_end(self, rt: Runtime, epoch: int, ctx: dict[str, Any], exc: BaseException,
                    state: str) -> None:
        """Record ``failed``/``ignored``; what to do when a newer execution owns the work."""
        try:
            rt.store.fail(ctx["work_key"], epoch, f"{type(exc).__name__}: {exc}", state,
                          codec.failure_json(exc) if state == FAILED else None)
            if killpoints.ARMED and state == FAILED:
                killpoints.reached("after_failed")
        except StaleClaimError as fenced:
            row = rt.store.get_work(ctx["work_key"])
            if row is not None and row.task_id == ctx["task_id"] and row.state == state:
                return  # a later execution of this very request ended it the same way
            self._fenced(epoch, ctx, f"{state} not recorded: superseded")
            if isinstance(fenced, WorkStopped):
                self._report_revoked(str(fenced))
            raise Ignore() from exc
        except StoreUnavailable as down:
            self._retry_store_down(down, epoch)

    def _fenced(self, epoch: int, ctx: dict[str, Any], error: str) -> None:
        log.warning("fenced: %s", error, extra={"action": "fenced", **ctx})
        signals.send(signals.work_fenced, self.app, self.name, epoch=epoch, error=error, **ctx)

    def _already_reported(self, state: str) -> bool:
        """Whether the result backend already holds ``state`` (SUCCESS, FAILURE) for this
        request.

        Without a result backend nothing can tell; the copy then tells Celery again (the
        stored result, or the stored failure), and Celery sends the request's callbacks or
        errbacks again: docs/reliability.md.
        """
        req = self.request
        if req.is_eager or not self._stores_results():
            return False
        try:
            return bool(self.backend.get_state(req.id) == state)
        except Exception as exc:  # backend down: returning the stored result is the safe side
            log.warning("result backend unreadable for %s: %s", req.id, exc)
            return False

    def _ended_for_the_caller(self, rt: Runtime, claim: Claim, ctx: dict[str, Any]) -> bool:
        """Whether Celery already told the caller how this request ended, though the store
        still had it open; then the work ends the same way and nothing runs again.

        - FAILURE or REVOKED: a hard time limit or ``revoke(terminate=True)`` is recorded
          by the worker's main process after Celery stored the state and acked the message,
          and a SIGKILL while the store was slow or down loses that record. Plain Celery
          would run nothing: its message was acknowledged.
        - SUCCESS: a finish committed without waiting for the WAL flush (batched takes) and
          lost by a database crash before the flush; the result Celery stored is recorded
          and the chord part counted again where that counts it once (tasks/replay.py).

        Asked only of a resumed execution (``attempts > 1``), which the store re-published
        or a redelivery brought; without a result backend nothing can tell
        (docs/reliability.md)."""
        req = self.request
        if req.is_eager or not self._stores_results():
            return False
        try:
            meta = self.backend.get_task_meta(req.id)
        except Exception as exc:  # backend down: run, as before this check
            log.warning("result backend unreadable for %s: %s", req.id, exc)
            return False
        state = meta.get("status")
        if state not in (states.SUCCESS, states.FAILURE, states.REVOKED):
            return False
        result = meta.get("result")
        try:
            if state == states.SUCCESS:
                rt.store.finish(ctx["work_key"], claim.epoch,
                                codec.encode(_as_stored(result), f"result of {self.name}"))
            else:
                failure = (codec.failure_json(result) if isinstance(result, BaseException)
                           else None)
                rt.store.fail(ctx["work_key"], claim.epoch,
                              f"{state} already told to the caller",
                              REVOKED if state == states.REVOKED else FAILED, failure)
        except (StaleClaimError, StoreUnavailable, ResilientError) as exc:
            log.warning("work %s: could not record %s (%s)", ctx["work_key"], state, exc)
        log.warning("work %s not resumed: the caller was already told %s (its worker was "
                    "lost before the store heard of it)", ctx["work_key"], state,
                    extra={"action": "already_reported", **ctx})
        if state == states.SUCCESS:
            replay.report_again(self.backend, req, state, result,
                                wait_for_dispatch=not req.is_eager)
        return True

    def _stores_results(self) -> bool:
        return not (self.ignore_result or self.request.ignore_result
                    or isinstance(self.backend, DisabledBackend))

    def _report_revoked(self, reason: str) -> None:
        """The caller sees REVOKED, as for a request Celery itself discarded."""
        req = self.request
        if not self._stores_results():
            return
        try:
            self.backend.mark_as_revoked(req.id, reason, request=req)
        except Exception as exc:  # the work is ended in the store either way
            log.warning("could not mark %s revoked in the result backend: %s", req.id, exc)

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
        carrier = _carrying_id(sig, req.id)
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
        rt = self.resilient
        ctx = {"work_key": x.work_key, "task_id": self.request.id, "task": self.name}
        if continues:
            self._hand_back(rt, x.epoch, ctx, 0.0, 0, clear_checkpoint=True, replaced=True)
        else:
            self._record_end(rt, x.epoch, ctx, Ignore("replaced by a new task"), IGNORED)

    def _retry_store_down(self, exc: StoreUnavailable, epoch: int | None) -> Any:
        """The store is down: re-send this message later rather than fail or lose it."""
        rt = self.resilient
        n = int(_header(self.request, "resilient_store_retries") or 0)
        countdown = min(rt.config.store_retry_base * (2 ** n), rt.config.store_retry_max)
        headers = dict(self.request.headers or {})
        headers["resilient_store_retries"] = n + 1
        if epoch is not None:
            headers[SUPERSEDES_HEADER] = epoch  # the re-sent copy may take over this claim
        log.warning("store unavailable (%s); %s re-sent in %.1fs", exc, self.request.id,
                    countdown, extra={"action": "store_retry", "task_id": self.request.id})
        sig = self.signature_from_request(self.request, countdown=countdown, headers=headers)
        try:
            sig.apply_async()
        except Exception as publish_error:  # broker down too: let the broker keep it
            raise Reject(str(publish_error), requeue=True) from exc
        raise Retry(exc=exc, when=countdown, sig=sig)

    def _work_key_for(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return workkey.derive(self, task_id, args, kwargs, _headers_of(self.request))


def _has_canvas(req: Any) -> bool:
    """Whether Celery does more than store the result after this request's body: links,
    errbacks, a chain, a chord or a group (their recovery needs ``done`` first)."""
    return bool(req.callbacks or req.errbacks or req.chain or req.chord or req.group)


def _pin_link_ids(req: Any) -> None:
    """Each ``link`` callback of the request gets a task id derived from the request's.

    Celery sends a success's callbacks before it stores SUCCESS; a copy of the request that
    returns the stored result (its worker was killed in between, or it was delivered twice)
    makes Celery send them again. With the same id a resumable callback is the same work and
    runs once; without, it was a new task each time. A callback's own id is kept, and a
    canvas as a callback (a group, a chord) is sent as before: at least once.
    """
    for index, callback in enumerate(req.callbacks or ()):
        if isinstance(callback, dict) and not callback.get("subtask_type"):
            options = callback.setdefault("options", {})
            if not options.get("task_id"):
                options["task_id"] = str(uuid_module.uuid5(uuid_module.NAMESPACE_URL,
                                                           f"celery-resilient:{req.id}:link:{index}"))


def _as_stored(result: Any) -> Any:
    """A returned ``AsyncResult`` is kept as Celery's JSON backends keep it: its tuple."""
    return result.as_tuple() if isinstance(result, ResultBase) else result


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


def _headers_of(req: Any) -> dict[str, Any]:
    headers = dict(req.headers or {})
    for name in (workkey.HEADER, SUPERSEDES_HEADER, SCHEDULED_FOR_HEADER):
        value = getattr(req, name, None)
        if value is not None and name not in headers:
            headers[name] = value
    return headers


def _header(req: Any, name: str) -> Any:
    return _headers_of(req).get(name)


def _carrying_id(sig: Any, task_id: str) -> Any | None:
    """The task signature inside ``sig`` that Celery froze with ``task_id``: the signature
    itself, the last task of a chain, a chord's body (``celery.accumulate`` when a group was
    the replacement), at any depth."""
    body = getattr(sig, "body", None)
    tasks = getattr(sig, "tasks", None)
    if body is not None or tasks is not None:  # a canvas: look inside, the body first
        for part in ([body] if body is not None else []) + list(tasks or [])[::-1]:
            found = _carrying_id(part, task_id)
            if found is not None:
                return found
        return None
    return sig if getattr(sig, "id", None) == task_id else None


def _replacement_key(app: Any, sig: Any, task_id: str) -> str | None:
    """The work key the replacement's signature frozen with ``task_id`` derives, if that
    signature is a resumable task."""
    s = _carrying_id(sig, task_id)
    if s is None:
        return None
    task = app.tasks.get(s.task)
    if not isinstance(task, ResumableTask):
        return None
    try:
        return workkey.derive(task, task_id, s.args, s.kwargs, (s.options or {}).get("headers"))
    except ResilientError:
        return None


def _seconds_until(when: Any) -> float:
    """Retry.when (a countdown in seconds, or an ETA) as seconds from now."""
    if when is None:
        return 0.0
    if isinstance(when, (int, float)):
        return max(0.0, float(when))
    try:
        eta: datetime = maybe_iso8601(when) if isinstance(when, str) else when
        now = datetime.now(eta.tzinfo) if eta.tzinfo else datetime.now()
        return max(0.0, float((eta - now).total_seconds()))
    except (TypeError, ValueError, AttributeError):
        return 0.0


def _as_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _is_live_here(work_key: str, my_pid: int) -> Callable[
        [str | None, str | None, int | None], bool]:
    """Liveness of an execution recorded by this worker incarnation (same host)."""

    def is_live(node: str | None, incarnation: str | None, pid: int | None) -> bool:
        if pid == my_pid:  # running here, or ended here with its result not yet committed
            return identity.executing_here(work_key) or finishes.handed_here(work_key)
        return identity.pid_alive(pid)

    return is_live
