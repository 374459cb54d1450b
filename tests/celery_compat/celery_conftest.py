"""Copied as ``conftest.py`` into the root of Celery's sdist by ``test_celery_suite.py``.

With ``RESILIENT_CELERY_SUITE=resilient`` every app Celery's integration suite creates (the
session worker's and each test's) is set up as a user sets one up: ``Resilient(app)`` where
the app is created, on the store named in ``integration-tests-config.json``, and every task,
Celery's built-ins included, gets :class:`~celery_resilient.ResumableTask` as its base
through the app's ``task_cls``. With ``plain`` nothing is changed: the baseline.
"""

from __future__ import annotations

import os
from typing import Any

import celery.contrib.testing.app as celery_testing_app
import pytest

RESILIENT = os.environ.get("RESILIENT_CELERY_SUITE", "resilient") == "resilient"
#: ``i/n``: this run takes the i-th of every n tests, in collection order (the same for both
#: modes); unset, all of them. test_celery_suite.py runs the n shards at once.
SHARD = os.environ.get("RESILIENT_CELERY_SHARD", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SHARD:
        return
    index, count = (int(n) for n in SHARD.split("/"))
    config.hook.pytest_deselected(items=[t for n, t in enumerate(items) if n % count != index])
    items[:] = [t for n, t in enumerate(items) if n % count == index]


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, Any]:
    return {"task_cls": "celery_resilient.tasks.task:ResumableTask"} if RESILIENT else {}


if RESILIENT:
    _test_app = celery_testing_app.TestApp  # what celery.contrib.pytest builds its apps with

    def _resilient_test_app(*args: Any, **kwargs: Any) -> Any:
        from celery_resilient import Resilient

        app = _test_app(*args, **kwargs)
        Resilient(app)
        return app

    celery_testing_app.TestApp = _resilient_test_app
