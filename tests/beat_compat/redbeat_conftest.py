"""Copied as ``conftest.py`` into the fetched celery-redbeat source tree; not collected here.

RedBeat's tests import ``RedBeatScheduler`` from the ``redbeat`` package: they get
``ResilientScheduler``. Every Celery app they build with Celery's ``TestApp`` gets
``Resilient(app)`` with an SQLite store of its own.
"""

from __future__ import annotations

import tempfile
from typing import Any

import celery.contrib.testing.app as testing_app
import redbeat
from celery import Celery

from celery_resilient import Resilient
from celery_resilient.beat import ResilientScheduler

# Only the package attribute: redbeat.schedulers names RedBeatScheduler in its own super()
# calls, so replacing it there would make ResilientScheduler its own parent.
redbeat.RedBeatScheduler = ResilientScheduler

_celery_test_app = testing_app.TestApp
_stores = tempfile.mkdtemp(prefix="redbeat-suite-")


def _resilient_test_app(*args: Any, **kwargs: Any) -> Celery:
    app = _celery_test_app(*args, **kwargs)
    app.conf.resilient_store_url = f"sqlite:///{tempfile.mkdtemp(dir=_stores)}/store.sqlite3"
    Resilient(app)
    return app


testing_app.TestApp = _resilient_test_app
