"""Closing a test's (or a benchmark's) Celery app that waited on results in Redis."""

from __future__ import annotations

import gc
from typing import Any


def close_result_client(app: Any) -> None:
    """Close ``app`` and its result backend's connections, for good.

    A result still alive after the close (a chord's parent links keep results in reference
    cycles) unsubscribes when it is collected, and that reconnects a socket nobody closes:
    the garbage collector warns about it later, in some other test, or at interpreter exit.
    So: collect what is garbage now, close the pubsub, and forget its subscriptions so that
    later collections have nothing to unsubscribe.
    """
    gc.collect()
    backend = app.backend
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None and hasattr(consumer, "subscribed_to"):
        consumer.stop()
        consumer.subscribed_to.clear()
    if hasattr(backend, "client"):
        backend.client.connection_pool.disconnect()
    app.close()


__all__ = ["close_result_client"]
