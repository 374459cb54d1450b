"""Which transport a worker consumes through: the reliable fetch for Redis brokers.

The choice is made in the worker (``worker_init``), so producers, beat and other processes
keep whatever they had; they publish the same way either way. A user's own
``broker_transport`` is never replaced.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_HERE = __name__.rsplit(".", 1)[0] + ".transport"
#: URL scheme -> the transport that consumes it with the reliable fetch.
TRANSPORTS = {
    "redis": f"{_HERE}:Transport",
    "rediss": f"{_HERE}:Transport",
    "sentinel": f"{_HERE}:SentinelTransport",
}
SETTING = "resilient_reliable_fetch"


def _urls(conf: Any) -> list[str]:
    urls: list[str] = []
    for key in ("broker_url", "broker_read_url", "broker_write_url"):
        value = conf.get(key)
        if not value:
            continue
        items: Iterable[str] = value.split(";") if isinstance(value, str) else value
        urls.extend(u.strip() for u in items if u and u.strip())
    return urls


def choose(conf: Any, enabled: bool) -> tuple[str | None, str]:
    """The transport to set as ``broker_transport`` (None: leave it), and why, for the
    startup banner."""
    if not enabled:
        return None, f"off ({SETTING}=False)"
    if conf.get("broker_transport"):
        return None, f"off (broker_transport={conf.get('broker_transport')!r} is the user's)"
    schemes = {u.split("://", 1)[0].lower() if "://" in u else "" for u in _urls(conf)}
    if len(schemes) != 1:
        return None, "off (the broker URLs mix schemes)" if schemes else "off (no broker URL)"
    scheme = schemes.pop()
    transport = TRANSPORTS.get(scheme)
    if transport is None:
        return None, f"off ({scheme or 'amqp'}:// needs none)"
    return transport, "on"


def apply(app: Any, enabled: bool) -> str:
    """Set the reliable fetch's transport on ``app`` if it applies; return the banner phrase."""
    conf = app.conf
    transport, why = choose(conf, enabled)
    if transport is None:
        return why
    if not conf.get("broker_use_ssl"):
        # kombu turns TLS on for a rediss:// URL only when the transport is named by that
        # scheme; keep exactly what it would have used.
        ssl = app.connection_for_read().ssl
        if ssl:
            conf.broker_use_ssl = ssl
    conf.broker_transport = transport
    return why


def is_on(conf: Any) -> bool:
    return conf.get("broker_transport") in set(TRANSPORTS.values())


__all__ = ["SETTING", "TRANSPORTS", "apply", "choose", "is_on"]
