"""Test toolkit: real ``celery worker``/``celery beat`` processes you can SIGKILL, and effect logs.

Load the fixtures with ``pytest_plugins = ["celery_resilient.testing.plugin"]``. The nodes
follow pytest-celery's node API (``CeleryTestWorker``/``CeleryTestNode``) with a local
process in place of a Docker container, since resilience is proven by killing real processes.
"""

from typing import Any

from celery_resilient.testing.effects import EffectLog
from celery_resilient.testing.process import LocalProcess
from celery_resilient.testing.waiting import WaitTimeout, wait_for

__all__ = ["EffectLog", "LocalBeat", "LocalProcess", "LocalWorker", "WaitTimeout", "wait_for"]


def __getattr__(name: str) -> Any:
    """The nodes need pytest-celery (the ``testing`` extra); the rest does not."""
    if name in ("LocalBeat", "LocalWorker"):
        from celery_resilient.testing import nodes  # noqa: PLC0415  (pytest-celery is optional)

        return getattr(nodes, name)
    raise AttributeError(name)
