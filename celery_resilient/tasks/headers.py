"""The message headers a resumable request carries, and reading them from a request.

Celery copies a message's custom headers onto the request as attributes as well as into
``request.headers`` (depending on the protocol and the path), so each is looked up in both.
"""

from __future__ import annotations

from typing import Any

from celery_resilient.core import workkey

#: The epoch a re-sent message was sent to replace (a retry, a replacement, a store-outage
#: re-send): it may take over that epoch's claim without counting a death.
SUPERSEDES_HEADER = "resilient_supersedes"
#: The beat slot a scheduled run serves (ISO 8601).
SCHEDULED_FOR_HEADER = "resilient_scheduled_for"
#: How many times this message was re-sent because the store was down (the backoff's step).
STORE_RETRIES_HEADER = "resilient_store_retries"


def headers_of(req: Any) -> dict[str, Any]:
    """``req``'s headers, with ours found among its attributes too."""
    headers = dict(req.headers or {})
    for name in (workkey.HEADER, SUPERSEDES_HEADER, SCHEDULED_FOR_HEADER):
        value = getattr(req, name, None)
        if value is not None and name not in headers:
            headers[name] = value
    return headers


def header(req: Any, name: str) -> Any:
    return headers_of(req).get(name)


def as_int(value: Any) -> int | None:
    """A header's integer, or None when it is absent or not one."""
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
