"""Worker bootstep: the incarnation's lease, the maintainer, and the warm-shutdown hand-off.

Two background threads, so a slow or unreachable store or broker never stalls message
consumption and nothing stands between a lease and its renewal: ``LeaseKeeper``
(:mod:`celery_resilient.worker.lease`) and ``Maintainer``
(:mod:`celery_resilient.worker.maintainer`).

A warm shutdown (SIGTERM, SIGINT, ``celery control shutdown``) stops the sweeps, asks every
running ResumableTask to hand its work off at its next checkpoint (``resilient_shutdown``)
and keeps the lease alive while Celery drains the pool; the incarnation is marked stopped
only after the pool is empty (``worker_shutdown``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from celery import bootsteps
from celery import signals as celery_signals

from celery_resilient.broker import identity as broker_identity
from celery_resilient.core import handoff, identity, liveness
from celery_resilient.core.identity import Owner
from celery_resilient.errors import ResilientError
from celery_resilient.runtime.runtime import Runtime
from celery_resilient.store.engine import sanitize_url
from celery_resilient.store.sql import PROVEN_DEAD, SESSION_ALIVE, UNJUDGED
from celery_resilient.tasks import handed_results
from celery_resilient.worker import checks, holding_sweep, pool_drain, recovery
from celery_resilient.worker.backpressure import ConsumptionGate
from celery_resilient.worker.dispatch import BatchedDispatch
from celery_resilient.worker.fencing import FencingGuard
from celery_resilient.worker.lease import LeaseKeeper
from celery_resilient.worker.maintainer import Maintainer, store_marker

log = logging.getLogger(__name__)


def startup(rt: Runtime, owner: Owner) -> None:
    """Worker main process start: validate, check the schema, warn about broker limits."""
    cfg = rt.config
    _ = rt.store
    log.info(
        "celery-resilient: store=%s lease=%gs heartbeat=%gs sweep=%gs "
        "max_attempts=%d durable_submit=%s reliable_fetch=%s broker_link=(%s) node=%s "
        "incarnation=%s",
        sanitize_url(cfg.store_url), cfg.lease_seconds, cfg.heartbeat_interval,
        cfg.sweep_interval, cfg.max_attempts,
        "on" if cfg.durable_submit else "off (what a broker that loses its data held and no "
        "worker received is lost, as in Celery)", rt.fetch_mode,
        rt.broker_link, owner.node,
        owner.incarnation, extra={"action": "startup"},
    )
    for warning in [*rt.broker_link_warnings, *checks.time_limit_warnings(rt.app)]:
        log.warning(warning, extra={"action": "config_warning"})


def settle_predecessors(rt: Runtime, owner: Owner) -> None:
    """At start: end earlier incarnations of this node that are provably dead (from ``/proc``
    on this host and PID namespace, or, on PostgreSQL, because their liveness session has
    ended: another container, another host); warn loudly about one that is alive (two
    workers with one node name), or that cannot be judged, and leave its claims alone."""
    for other in rt.store.other_incarnations(owner):
        how = None
        probe = UNJUDGED
        if liveness.is_dead(other.process):
            how = "its process is gone" if rt.store.declare_dead(other.incarnation) else None
        else:
            probe = rt.store.prove_dead(other.incarnation, by=owner)
            if probe == PROVEN_DEAD:
                how = "its database session has ended"
        if how is not None:
            log.info("earlier start of %s (incarnation %s, pid %d on %s) is gone: %s; its "
                     "claims are taken back now", owner.node, other.incarnation, other.pid,
                     _host(other.process), how, extra={"action": "predecessor_dead",
                                                       "incarnation": other.incarnation})
            continue
        if liveness.is_dead(other.process):
            continue  # stopped meanwhile by someone else
        lease_end = other.lease_expires_at or other.heartbeat_at + rt.config.lease_seconds
        if lease_end <= other.db_now:
            continue  # its lease has expired: the sweep takes its claims back
        renewed = other.db_now - other.heartbeat_at
        alive = ("its process runs on this host" if liveness.is_alive(other.process)
                 else "its database session is alive" if probe == SESSION_ALIVE else None)
        if alive is not None:
            log.warning(
                "ANOTHER LIVE WORKER USES THE NODE NAME %s (incarnation %s, pid %d on %s; %s, "
                "lease renewed %.0fs ago). Its claims are left alone, but give every worker "
                "a unique name (celery worker -n name@%%h).", owner.node, other.incarnation,
                other.pid, _host(other.process), alive, renewed,
                extra={"action": "duplicate_node_name", "incarnation": other.incarnation})
        else:
            log.warning(
                "CANNOT TELL WHETHER THE EARLIER START OF %s IS ALIVE (incarnation %s, pid %d "
                "on %s; lease renewed %.0fs ago; it holds no liveness session, so only its "
                "host could prove it dead). Its claims wait for its lease (%gs). On "
                "PostgreSQL keep resilient_session_liveness on (with resilient_liveness_url "
                "a direct URL behind a pooler), and give every worker a unique name.",
                owner.node, other.incarnation, other.pid, _host(other.process), renewed,
                rt.config.lease_seconds,
                extra={"action": "duplicate_node_name", "incarnation": other.incarnation})




def _batched_dispatch(rt: Runtime, owner: Owner, worker: Any) -> BatchedDispatch | None:
    """Batched takes for a prefork pool on Celery's event loop (``resilient_batched_takes``);
    other pools (solo, threads, gevent, eventlet) take claims in the task."""
    hub = getattr(worker, "hub", None)
    pool_module = type(getattr(worker, "pool", None)).__module__
    if not rt.config.batched_takes or hub is None or pool_module != "celery.concurrency.prefork":
        return None
    dispatch = BatchedDispatch(rt, owner)  # the consumer attaches it to its event loop
    dispatch.start()
    rt.dispatcher = dispatch
    return dispatch


def _host(process: str | None) -> str:
    return (process or "?").split(liveness.SEP)[0]


class ResilientWorkerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Start the lease keeper and the maintainer once the pool is up; hand off at shutdown."""

    requires = {"celery.worker.components:Pool"}
    label = "celery-resilient"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.maintainer: Maintainer | None = None
        self.dispatch: BatchedDispatch | None = None
        self.keeper: LeaseKeeper | None = None
        self.guard: FencingGuard | None = None
        self.hostname: str | None = None
        super().__init__(worker, **kwargs)
        rt = Runtime.enabled_on(worker.app)
        if rt is not None and rt.config.batched_takes and rt.store.dialect.group_commits:
            # before the pool forks (this step starts after it): the pool processes inherit
            # the pipe they hand their results through (tasks/handed_results.py)
            handed_results.open_channel()

    def start(self, worker: Any) -> None:
        rt = Runtime.of(worker.app)
        owner = Owner(worker.hostname, identity.incarnation(), os.getpid())
        self.hostname = worker.hostname
        handoff.reset()
        startup(rt, owner)
        rt.receipts.max_bytes = rt.config.receipt_buffer_bytes
        marker = store_marker(rt)
        recovery.first_look(rt, marker)
        broker = dataclasses.replace(broker_identity.of_app(worker.app, rt.config.broker_name),
                                     token=marker.broker_token)
        rt.store.register(owner, liveness.current(), rt.config.lease_seconds, broker.dumps())
        settle_predecessors(rt, owner)
        checks.refuse_foreign_brokers(rt, owner, broker)
        self.keeper = LeaseKeeper(rt, owner)
        self.keeper.start()
        gate = rt.gate = ConsumptionGate(worker)
        self.guard = FencingGuard(rt, owner, self.keeper, gate=gate)
        self.guard.open_session()
        self.guard.start()
        log.info("celery-resilient: liveness=%s fence_after=%gs", self.guard.describe(),
                 rt.config.fence_after, extra={"action": "startup"})
        self.maintainer = Maintainer(rt, owner, self.keeper, gate, marker, broker)
        self.maintainer.give_back_first()
        self.maintainer.start()
        self.dispatch = _batched_dispatch(rt, owner, worker)
        # a warm shutdown drains the jobs already written to pool processes (an upstream bug)
        pool_drain.keep_written_jobs(getattr(worker, "pool", None))
        log.info("celery-resilient: batched_takes=%s", "on" if self.dispatch is not None else
                 "off (resilient_batched_takes, or not a prefork pool on the event loop)",
                 extra={"action": "startup"})
        celery_signals.worker_shutting_down.connect(self._on_shutting_down, weak=False)
        celery_signals.worker_shutdown.connect(self._on_shutdown, weak=False)

    def _on_shutting_down(self, sender: Any = None, how: str = "Warm", **_: Any) -> None:
        """Runs in Celery's signal handler: only raise the flag the pool processes read."""
        if sender == self.hostname and how == "Warm":
            self._request_hand_off()

    def _request_hand_off(self) -> None:
        if self.maintainer is not None and self.maintainer.rt.config.shutdown == "hand_off":
            handoff.request()

    def stop(self, worker: Any) -> None:
        """Warm shutdown, before the pool drains: hand off, keep the lease, stop sweeping."""
        if self.maintainer is None:
            return
        self._request_hand_off()
        if self.dispatch is not None:
            # No more batched takes; results of the drain still flush before their acks.
            self.dispatch.stop()
        self.maintainer.draining = True
        rt, owner = self.maintainer.rt, self.maintainer.owner
        try:
            rt.store.mark_draining(owner)
        except Exception as exc:  # raised out of a stop step, it cuts
            # Celery's shutdown short: the pool is never joined and the worker hangs at exit.
            log.warning("could not record the drain: %s", exc,
                        exc_info=not isinstance(exc, ResilientError))
        log.info("warm shutdown: %s; lease kept until the pool has drained",
                 "running resumable work hands off at its next checkpoint"
                 if rt.config.shutdown == "hand_off" else "running work drains",
                 extra={"action": "draining"})

    def terminate(self, worker: Any) -> None:
        """Cold shutdown: the pool is killed next; the claims are orphans at once."""
        self._finish()

    def _on_shutdown(self, sender: Any = None, **_: Any) -> None:
        """``worker_shutdown``: the pool has drained."""
        if sender is not None and getattr(sender, "hostname", self.hostname) == self.hostname:
            self._finish()

    def _stop_dispatch(self) -> None:
        """No more batched takes: what was not handed to the pool yet stays unacked (the
        broker restores it), and its claims go back at the stop (``mark_stopped``)."""
        dispatch, self.dispatch = self.dispatch, None
        if dispatch is not None:
            dispatch.stop()
            dispatch.rt.dispatcher = None

    def _finish(self) -> None:
        self._stop_dispatch()
        maintainer, keeper, guard = self.maintainer, self.keeper, self.guard
        self.maintainer = self.keeper = self.guard = None
        if maintainer is not None:
            maintainer.rt.gate = None
        celery_signals.worker_shutting_down.disconnect(self._on_shutting_down)
        celery_signals.worker_shutdown.disconnect(self._on_shutdown)
        if maintainer is None:
            return
        maintainer.stop()
        maintainer.join(timeout=5)
        try:
            maintainer.flush_receipts()
            maintainer.rt.outcomes.flush(maintainer.rt.store)
            maintainer.revokes.flush(maintainer.rt)
            maintainer.rt.store.mark_stopped(maintainer.owner, maintainer.rt.config.submit_timeout)
            # Stopped in the store: the lease's heartbeat would now read this incarnation's
            # own stop as another worker declaring it dead (and fence, and exit 1) while the
            # holdings are forgotten below (slow with the broker down).
            _stop_lease(keeper, guard)
            keeper = guard = None
            holding_sweep.forget_own(maintainer.rt, maintainer.owner)
        except Exception as exc:  # never cut Celery's shutdown short
            log.warning("could not hand claims back on shutdown: %s", exc,
                        exc_info=not isinstance(exc, ResilientError))
        finally:
            _stop_lease(keeper, guard)


def _stop_lease(keeper: LeaseKeeper | None, guard: FencingGuard | None) -> None:
    """Stop renewing the lease and watching the liveness session."""
    if guard is not None:
        guard.stop()
        guard.join(timeout=5)
        guard.close()
    if keeper is not None:
        keeper.stop()
        keeper.join(timeout=5)

