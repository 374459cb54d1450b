"""Which requests the fence stops by ending the worker: those Celery runs in the worker's own
process. gevent's and eventlet's pools report a green thread's ``id()`` as the worker pid,
which the fence once took for a process to SIGKILL (``OverflowError``: nothing stopped)."""

from __future__ import annotations

import os

import pytest

from celery_resilient.worker.fence import runs_in_this_process


def test_solo_and_threads_report_this_process() -> None:
    assert runs_in_this_process(os.getpid())


def test_a_green_thread_s_id_is_this_process() -> None:
    greenlet = pytest.importorskip("greenlet")  # what gevent and eventlet run on
    assert runs_in_this_process(id(greenlet.getcurrent()))


def test_a_pool_process_is_not() -> None:
    assert not runs_in_this_process(os.getppid())
