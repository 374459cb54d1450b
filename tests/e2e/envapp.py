"""The e2e apps' shared setup: a Celery app with Resilient(app), configured by environment.

RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE and optional
RESILIENT_EXTRA (JSON of extra app.conf settings). No app is created at import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from celery import Celery

from celery_resilient import Resilient


def app_from_env(name: str, env: Mapping[str, str], **celery: Any) -> Celery:
    """A Celery app with Resilient(app), configured from the e2e environment variables."""
    app = Celery(name, broker=env.get("RESILIENT_BROKER", "redis://127.0.0.1:6379/9"),
                 set_as_current=False, **celery)
    app.conf.update(
        resilient_store_url=env.get("RESILIENT_STORE_URL") or None,
        resilient_table_prefix=env.get("RESILIENT_TABLE_PREFIX", "resilient_"),
        task_default_queue=env.get("RESILIENT_QUEUE", "celery"),
        worker_prefetch_multiplier=4,
        broker_connection_retry_on_startup=True,
    )
    app.conf.update(json.loads(env.get("RESILIENT_EXTRA", "{}")))
    Resilient(app)
    return app
