"""Optional Prometheus counters for the recovery signals (extra ``prometheus``).

With ``resilient_metrics = True`` the counters below are registered in prometheus-client's
default registry and connected to :mod:`celery_resilient.signals` in every process that sends
one. Exposing them is the application's choice, as with any prometheus-client metric; a
prefork worker's pool processes count in their own memory, so use prometheus-client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) to scrape one worker as a whole. See
``docs/operations.md``.

=========================================  ===========  ====================================
counter                                    labels       incremented by
=========================================  ===========  ====================================
``resilient_work_recovered_total``         ``task``     ``signals.work_recovered``
``resilient_duplicates_skipped_total``     ``task``     ``signals.duplicate_skipped``
``resilient_work_fenced_total``            ``task``     ``signals.work_fenced``
``resilient_work_dead_total``              ``task``     ``signals.work_dead``
``resilient_slots_caught_up_total``        ``entry``    ``signals.slot_caught_up``
``resilient_work_handed_off_total``        ``task``     ``signals.work_handed_off``
``resilient_rows_pruned_total``            ``table``    ``signals.rows_pruned`` (by ``rows``)
=========================================  ===========  ====================================
"""

from __future__ import annotations

import threading
from typing import Any

from celery.utils.dispatch import Signal
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from celery_resilient import signals

_installed: ResilientMetrics | None = None
_lock = threading.Lock()


class ResilientMetrics:
    """The counters, registered in ``registry``; :meth:`connect` ties them to the signals."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.work_recovered = Counter(
            "resilient_work_recovered", "Orphaned work re-published with its task id",
            ["task"], registry=registry)
        self.duplicates_skipped = Counter(
            "resilient_duplicates_skipped", "Deliveries that ran nothing (done, held, failed)",
            ["task"], registry=registry)
        self.work_fenced = Counter(
            "resilient_work_fenced", "Writes of superseded executions refused",
            ["task"], registry=registry)
        self.work_dead = Counter(
            "resilient_work_dead", "Deliveries refused because the work is dead",
            ["task"], registry=registry)
        self.slots_caught_up = Counter(
            "resilient_slots_caught_up", "Missed beat slots sent late",
            ["entry"], registry=registry)
        self.work_handed_off = Counter(
            "resilient_work_handed_off", "Executions handed to another worker at shutdown",
            ["task"], registry=registry)
        self.rows_pruned = Counter(
            "resilient_rows_pruned", "Rows deleted by automatic retention",
            ["table"], registry=registry)
        self._by_signal: dict[Signal, Counter] = {  # label: the signal's sender
            signals.work_recovered: self.work_recovered,
            signals.duplicate_skipped: self.duplicates_skipped,
            signals.work_fenced: self.work_fenced,
            signals.work_dead: self.work_dead,
            signals.slot_caught_up: self.slots_caught_up,
            signals.work_handed_off: self.work_handed_off,
            signals.rows_pruned: self.rows_pruned,
        }
        #: Signals that count more than one per send: the keyword argument holding how many.
        self._amounts: dict[Signal, str] = {signals.rows_pruned: "rows"}
        self._uid = f"celery_resilient.runtime.metrics:{id(self)}"

    def _receive(self, signal: Signal | None = None, sender: Any = None,
                 **kwargs: Any) -> None:
        if signal is None or (counter := self._by_signal.get(signal)) is None:
            return
        amount = kwargs.get(self._amounts[signal], 1) if signal in self._amounts else 1
        if amount > 0:
            counter.labels(str(sender)).inc(amount)

    def connect(self) -> ResilientMetrics:
        for signal in self._by_signal:
            signal.connect(self._receive, weak=False, dispatch_uid=self._uid)
        return self

    def disconnect(self) -> None:
        for signal in self._by_signal:
            signal.disconnect(self._receive, dispatch_uid=self._uid)


def install() -> ResilientMetrics:
    """Register the counters in the default registry and connect them, once per process."""
    global _installed
    with _lock:
        if _installed is None:
            _installed = ResilientMetrics().connect()
        return _installed


__all__ = ["ResilientMetrics", "install"]
