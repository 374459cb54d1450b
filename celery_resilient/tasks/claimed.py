"""One claimed execution of a resumable request, and every way it ends.

``ResumableTask`` takes the claim; a :class:`ClaimedRun` runs the body under it and ends it
by what Celery does next, each ending a method named after its transition: ``finish``
(``done``, before the ack), ``hand_back`` (``requeued`` for the retry or replacement Celery
sends), ``hand_off`` (a warm shutdown: re-published now for another worker), ``end``
(``failed`` or ``ignored``), and ``fenced`` (a newer execution owns the work). The store is
told before Celery acts on the outcome, so a kill between them leaves the store's record
to decide what a copy does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

from celery import states
from celery.exceptions import Ignore, Reject, Retry
from celery.result import ResultBase
from celery.utils.time import maybe_iso8601

from celery_resilient import signals
from celery_resilient.core import codec, handoff, killpoints, messages
from celery_resilient.core.states import FAILED, IGNORED, REVOKED
from celery_resilient.errors import (
    ResilientError,
    StaleClaimError,
    StoreUnavailable,
    WorkStopped,
)
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.sql import Claim
from celery_resilient.tasks import canvas, handed_claims, handed_results, replay, result_backend
from celery_resilient.tasks.headers import STORE_RETRIES_HEADER, SUPERSEDES_HEADER, header

log = logging.getLogger(__name__)


class ClaimedRun:
    """The claim at ``epoch`` on ``ctx["work_key"]``, held by ``task``'s current request."""

    def __init__(self, task: Any, rt: Runtime, epoch: int, ctx: dict[str, Any]) -> None:
        self.task = task
        self.rt = rt
        self.epoch = epoch
        #: work_key, task_id and task name: the fields of every log line and signal
        self.ctx = ctx

    @property
    def work_key(self) -> str:
        return str(self.ctx["work_key"])

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any],
            body: Callable[..., Any] | None = None) -> Any:
        """Run the body (None: the task's ``run``) and end the claim by what Celery will do
        next."""
        task, x = self.task, self.task.execution
        try:
            if x.attempts > 1:
                log.info("resuming work %s (attempt %d)", self.work_key, x.attempts,
                         extra={"action": "resumed", **self.ctx})
                task.on_resume(x.attempts)
            result = (task.run if body is None else body)(*args, **kwargs)
            self.finish(result)
            return result
        except Retry as retry:
            # Celery published the retry (within max_retries): hand the claim to it, unless
            # new arguments make the retry another unit of work.
            req = task.request
            next_key = getattr(req, "resilient_retry_key", None) or self.work_key
            if next_key != self.work_key:
                self.end(Ignore(f"retried as work {next_key!r}"), IGNORED)
            else:
                self.hand_back(_seconds_until(retry.when), int(req.retries or 0) + 1)
            raise
        except Reject as reject:
            if reject.requeue:
                self.hand_back(0.0, int(task.request.retries or 0))
            else:
                self.end(reject, FAILED)
            raise
        except handoff.HandOff:
            self.hand_off()
            raise Ignore() from None
        except WorkStopped as exc:
            log.warning("stopped: %s", exc, extra={"action": "stopped", **self.ctx})
            result_backend.report_revoked(task, str(exc))
            raise Ignore() from exc
        except StaleClaimError as exc:
            self.fenced(str(exc))
            raise Ignore() from exc
        except StoreUnavailable as exc:
            resend_while_store_down(task, exc, self.epoch)
        except Ignore as ignore:
            if not getattr(task.request, "resilient_replaced", False):
                self.end(ignore, IGNORED)
            raise
        except Exception as exc:
            self.end(exc, FAILED)
            raise

    def finish(self, result: Any) -> None:
        """``done`` with its result, committed before Celery acknowledges the message:
        handed to the main process's group commit where that may be, else written here."""
        result_json = codec.encode(as_stored(result), f"result of {self.task.name}")
        handed_over = self._hand_finish(result_json)
        if not handed_over:
            self.rt.store.finish(self.work_key, self.epoch, result_json,
                                 flushed=not self.task.execution.handed)
        if killpoints.ARMED:
            if handed_over:
                killpoints.reached("after_finish_handed")
            if not handed_over or killpoints.SCOPE == "process":
                killpoints.reached("before_ack")  # else in the main process, once committed

    def _hand_finish(self, result_json: str) -> bool:
        """Hand the result to the main process's group commit (``tasks/handed_results.py``): only
        a claim it handed and surely still this worker's, for a request whose result nobody
        is told (no result stored: the store's ``done`` still comes before any SUCCESS a
        caller can read) and with no canvas."""
        task, x = self.task, self.task.execution
        return (x.handed and handed_claims.still_own(x.handed_generation)
                and not result_backend.stores_results(task)
                and not canvas.has_canvas(task.request)
                and handed_results.hand(self.work_key, self.epoch, result_json))

    def hand_back(self, delay: float, next_retries: int, clear_checkpoint: bool = False,
                  replaced: bool = False) -> None:
        """The claim goes back to ``requeued``: the re-sent message takes it, no death."""
        try:
            self.rt.store.release(self.work_key, self.epoch,
                                  delay + self.rt.config.submit_timeout, next_retries,
                                  clear_checkpoint, replaced)
        except StaleClaimError:
            pass  # the re-sent copy (marked as superseding this epoch) already took it over
        except StoreUnavailable as exc:
            log.warning("could not hand %s back (%s); the re-sent copy takes it over",
                        self.work_key, exc, extra={"action": "store_retry", **self.ctx})

    def hand_off(self) -> None:
        """Warm shutdown: the claim goes back with its checkpoint and the message is
        re-published now, so another worker resumes the work at once.

        If the store cannot take the claim back, the broker keeps the message (requeued)
        and the claim is an orphan as soon as this incarnation is marked stopped. If the
        re-publish fails, the sweeper sends the stored message when the hold expires.
        """
        rt, task, work_key = self.rt, self.task, self.work_key
        retries = int(task.request.retries or 0)
        try:
            message = rt.store.get_message(work_key)
            rt.store.release(work_key, self.epoch, rt.config.submit_timeout, retries)
        except StaleClaimError:
            return  # another execution took it over meanwhile: nothing to hand
        except StoreUnavailable as exc:
            log.warning("hand-off of %s failed (%s); the broker keeps its message", work_key,
                        exc, extra={"action": "hand_off_failed", **self.ctx})
            raise Reject(str(exc), requeue=True) from None
        sent = False
        if message is not None:
            try:
                with task.app.connection_for_write() as conn:
                    messages.publish(conn, message, {messages.REPUBLISHED_HEADER: 1}, task.app,
                                     retries=retries, started=True)
                sent = True
            except Exception as exc:
                log.warning("hand-off of %s: re-publish failed (%s); the sweeper sends it "
                            "after %.0fs", work_key, exc, rt.config.submit_timeout,
                            extra={"action": "hand_off_failed", **self.ctx})
        log.info("handed off work %s at epoch %d (warm shutdown)%s", work_key, self.epoch,
                 "" if sent else "; not re-published yet",
                 extra={"action": "handed_off", **self.ctx})
        signals.send(signals.work_handed_off, task.app, task.name, epoch=self.epoch,
                     republished=sent, **self.ctx)

    def end(self, exc: BaseException, state: str) -> None:
        """Record ``failed`` or ``ignored``; what to do when a newer execution owns the
        work."""
        rt, task = self.rt, self.task
        try:
            rt.store.fail(self.work_key, self.epoch, f"{type(exc).__name__}: {exc}", state,
                          codec.failure_json(exc) if state == FAILED else None)
            if killpoints.ARMED and state == FAILED:
                killpoints.reached("after_failed")
        except StaleClaimError as fenced:
            row = rt.store.get_work(self.work_key)
            if row is not None and row.task_id == self.ctx["task_id"] and row.state == state:
                return  # a later execution of this very request ended it the same way
            self.fenced(f"{state} not recorded: superseded")
            if isinstance(fenced, WorkStopped):
                result_backend.report_revoked(task, str(fenced))
            raise Ignore() from exc
        except StoreUnavailable as down:
            resend_while_store_down(task, down, self.epoch)

    def fenced(self, error: str) -> None:
        """A newer execution owns the work: this one's outcome is not recorded."""
        log.warning("fenced: %s", error, extra={"action": "fenced", **self.ctx})
        signals.send(signals.work_fenced, self.task.app, self.task.name, epoch=self.epoch,
                     error=error, **self.ctx)

    def end_as_told(self, claim: Claim) -> bool:
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
        task = self.task
        found = result_backend.told(task)
        if found is None:
            return False
        state, result = found
        try:
            if state == states.SUCCESS:
                self.rt.store.finish(self.work_key, claim.epoch,
                                     codec.encode(as_stored(result), f"result of {task.name}"))
            else:
                failure = (codec.failure_json(result) if isinstance(result, BaseException)
                           else None)
                self.rt.store.fail(self.work_key, claim.epoch,
                                   f"{state} already told to the caller",
                                   REVOKED if state == states.REVOKED else FAILED, failure)
        except (StaleClaimError, StoreUnavailable, ResilientError) as exc:
            log.warning("work %s: could not record %s (%s)", self.work_key, state, exc)
        log.warning("work %s not resumed: the caller was already told %s (its worker was "
                    "lost before the store heard of it)", self.work_key, state,
                    extra={"action": "already_reported", **self.ctx})
        if state == states.SUCCESS:
            replay.report_again(task.backend, task.request, state, result,
                                wait_for_dispatch=not task.request.is_eager)
        return True


def resend_while_store_down(task: Any, exc: StoreUnavailable, epoch: int | None) -> NoReturn:
    """The store is down: re-send this message later rather than fail or lose it (the
    re-sent copy may take over the claim at ``epoch``)."""
    rt = Runtime.of(task.app)
    req = task.request
    n = int(header(req, STORE_RETRIES_HEADER) or 0)
    countdown = min(rt.config.store_retry_base * (2 ** n), rt.config.store_retry_max)
    headers = dict(req.headers or {})
    headers[STORE_RETRIES_HEADER] = n + 1
    if epoch is not None:
        headers[SUPERSEDES_HEADER] = epoch  # the re-sent copy may take over this claim
    log.warning("store unavailable (%s); %s re-sent in %.1fs", exc, req.id,
                countdown, extra={"action": "store_retry", "task_id": req.id})
    sig = task.signature_from_request(req, countdown=countdown, headers=headers)
    try:
        sig.apply_async()
    except Exception as publish_error:  # broker down too: let the broker keep it
        raise Reject(str(publish_error), requeue=True) from exc
    raise Retry(exc=exc, when=countdown, sig=sig)


def as_stored(result: Any) -> Any:
    """A returned ``AsyncResult`` is kept as Celery's JSON backends keep it: its tuple."""
    return result.as_tuple() if isinstance(result, ResultBase) else result


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
