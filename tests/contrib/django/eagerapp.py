"""A project's Celery app in eager mode, loaded as a project loads it: before the test database.

Its configuration is read at import (collection time), so its store URL is first derived
from the real ``DATABASES["default"]``; the test database is created later and the store
must follow it.
"""

from __future__ import annotations

from celery import Celery

from celery_resilient import Resilient, ResumableTask
from celery_resilient.contrib.django import configure_from_django

app = Celery("djproj-eager", set_as_current=False)
app.config_from_object("django.conf:settings", namespace="CELERY")
Resilient(app)
configure_from_django(app)  # made after Django's setup: ready() has not seen it
app.conf.update(task_always_eager=True, task_store_eager_result=False)  # loads the config
REAL_STORE_URL = app.conf.resilient_store_url

calls: list[str] = []


@app.task(base=ResumableTask, bind=True, shared=False, name="djproj.import_rows")
def import_rows(self: ResumableTask, rows: int) -> int:
    calls.append(self.request.id)
    state = self.checkpoint.load(default={"done": 0})
    state["done"] = rows
    self.checkpoint.save(state)
    return int(state["done"])
