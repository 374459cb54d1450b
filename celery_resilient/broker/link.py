"""Bounds on a worker's broker link, so a cut link ends in an error instead of a hang.

redis-py sets no socket timeout by default: with the link black-holed, a worker's main process
blocked in Celery's worker-heartbeat publish for the whole cut, and its prefetched work waited
for the link while other workers sat idle. In the worker (``worker_init``), unless the user set
them: Redis connections get a socket timeout and TCP keepalives with ``TCP_USER_TIMEOUT``, so
sent data unacknowledged for 10 s, or an idle link silent for 11 s, ends the connection; Celery
then reconnects by itself, and the worker lets go of what it can no longer acknowledge (its
reserved claims lapse for other workers; what it had fetched is given back once the link
returns). RabbitMQ connections already carry ``TCP_USER_TIMEOUT`` (py-amqp); they get AMQP
heartbeats every 10 s instead of Celery's 120 s, so an idle cut link is noticed within about
20 s, and ``broker_channel_error_retry``: a channel the server closes (``consumer_timeout``
passed for a delivery: a long task) is opened again, as a lost connection is, instead of
ending the worker ("Unrecoverable error: PreconditionFailed"); the running tasks go on. A
user's own setting that turns a bound off is kept, with a warning that names it.
"""

from __future__ import annotations

import socket
from typing import Any

#: Redis transport options set when the user set none of that name.
REDIS_SOCKET_TIMEOUT = 10.0
REDIS_CONNECT_TIMEOUT = 5.0
REDIS_KEEPALIVE = {name: value for name, value in (
    ("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
    ("TCP_USER_TIMEOUT", 10_000)) if hasattr(socket, name)}
AMQP_HEARTBEAT = 10.0


def _scheme(conf: Any) -> str:
    url = conf.get("broker_url") or ""
    if not isinstance(url, str):
        url = next(iter(url), "")
    return url.split(";", 1)[0].split("://", 1)[0].split("+", 1)[0].lower() if "://" in url \
        else "amqp"


def apply(conf: Any) -> tuple[str, list[str]]:
    """Set the bounds this broker lacks; return a banner phrase and warnings for a user's own
    setting that turns one off."""
    scheme = _scheme(conf)
    warnings: list[str] = []
    if scheme in ("redis", "rediss", "sentinel"):
        options = dict(conf.get("broker_transport_options") or {})
        defaults: dict[str, Any] = {
            "socket_timeout": REDIS_SOCKET_TIMEOUT,
            "socket_connect_timeout": REDIS_CONNECT_TIMEOUT,
            "socket_keepalive": True,
            "socket_keepalive_options": {getattr(socket, k): v
                                         for k, v in REDIS_KEEPALIVE.items()},
        }
        for name, value in defaults.items():
            if name not in options:
                options[name] = value
            elif not options[name]:
                warnings.append(
                    f"broker_transport_options[{name!r}]={options[name]!r} leaves the Redis "
                    "link without that bound: a cut link can hang the worker's main process "
                    f"and keep its prefetched work from other workers (default here: "
                    f"{value!r})")
        conf.broker_transport_options = options
        return (f"socket_timeout={options['socket_timeout']}s "
                f"keepalive={'on' if options['socket_keepalive'] else 'off'}", warnings)
    if scheme in ("amqp", "amqps", "pyamqp"):
        if "broker_channel_error_retry" not in conf.changes:
            conf.broker_channel_error_retry = True
        elif not conf.broker_channel_error_retry:
            warnings.append(
                "broker_channel_error_retry=False: a channel RabbitMQ closes (its "
                "consumer_timeout: a task ran longer than it) ends the worker instead of "
                "reopening the channel; its running work then waits for a restart")
        if "broker_heartbeat" not in conf.changes:
            conf.broker_heartbeat = AMQP_HEARTBEAT
        elif not conf.broker_heartbeat:
            warnings.append(
                f"broker_heartbeat={conf.broker_heartbeat!r} turns AMQP heartbeats off: a cut "
                "idle link is noticed only by TCP keepalives (minutes); default here: "
                f"{AMQP_HEARTBEAT:g}")
        return (f"heartbeat={conf.broker_heartbeat or 0:g}s channel_error_retry="
                f"{'on' if conf.broker_channel_error_retry else 'off'}", warnings)
    return "as configured", warnings


__all__ = ["AMQP_HEARTBEAT", "REDIS_KEEPALIVE", "REDIS_SOCKET_TIMEOUT", "apply"]
