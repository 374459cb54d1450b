"""Which broker a worker consumes from, as something two workers can compare.

Every worker of one store re-publishes the work the store holds into its own broker (orphans,
hand-offs, what a broker that lost its data no longer has). Two apps on different brokers
that share one store and table prefix would each send the other's work where nobody consumes
it, so a worker refuses to start beside a live worker of its store on another broker
(:func:`celery_resilient.worker.checks.refuse_foreign_brokers`).

A broker is named by its endpoints: ``transport://host:port/virtual-host`` for the host as
written and for each address it resolves to (so ``localhost`` and ``127.0.0.1`` agree), with
the transport options that make one server several brokers (Redis's ``global_keyprefix``,
Sentinel's ``master_name``). Two workers use the same broker when their endpoints meet: a
failover list counts as one broker. Where the addresses do not meet (a worker in a network
namespace, NAT, a proxy), a Redis broker is recognised by a token it keeps
(``keys.BROKER_TOKEN``), which every worker reads at its start and each sweep; any other
broker needs ``resilient_broker_name`` to name it.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kombu.utils.url import parse_url

#: ``broker_transport_options`` that make one server address several brokers.
_SEPARATING_OPTIONS = ("global_keyprefix", "master_name")
#: What a worker with no broker URL consumes from (Celery's default).
_CELERY_DEFAULT = "amqp://guest@localhost//"
#: URL schemes that name one protocol through different client libraries.
_SAME_PROTOCOL = {"pyamqp": "amqp", "librabbitmq": "amqp", "pyamqps": "amqps"}
#: What an empty virtual host means, so ``redis://h`` and ``redis://h/0`` agree.
_DEFAULT_VHOST = {"redis": "0", "rediss": "0", "sentinel": "0", "amqp": "/", "amqps": "/"}
_DEFAULT_PORT = {"redis": 6379, "rediss": 6379, "sentinel": 26379, "amqp": 5672, "amqps": 5671}


@dataclass(frozen=True)
class BrokerIdentity:
    """A broker as a worker records it in the store: what an operator reads, what compares."""

    #: The broker URLs without credentials, for messages.
    shown: str
    #: Endpoints; two identities name one broker when these meet.
    endpoints: frozenset[str]
    #: The broker's own token as the worker last read it (``keys.BROKER_TOKEN``; Redis
    #: only): one broker reached through addresses that do not meet (a network namespace,
    #: NAT) shows both workers one token.
    token: str | None = None

    def same_broker(self, other: BrokerIdentity) -> bool:
        if self.endpoints & other.endpoints:
            return True
        return self.token is not None and self.token == other.token

    def dumps(self) -> str:
        return json.dumps({"shown": self.shown, "endpoints": sorted(self.endpoints),
                           "token": self.token}, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> BrokerIdentity | None:
        """The identity another worker recorded; None when it is unreadable (never fatal)."""
        try:
            data = json.loads(text)
            token = data.get("token")
            return cls(str(data["shown"]), frozenset(str(e) for e in data["endpoints"]),
                       None if token is None else str(token))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def of_app(app: Any, name: str | None = None) -> BrokerIdentity:
    """The identity of the broker ``app``'s worker consumes from (``name`` given: that)."""
    urls = _read_urls(app.conf)
    shown = ";".join(dict.fromkeys(_without_credentials(u) for u in urls))
    if name:
        return BrokerIdentity(f"{name} ({shown})", frozenset({f"name:{name}"}))
    options = app.conf.broker_transport_options or {}
    separate = "".join(f"#{key}={options[key]}" for key in _SEPARATING_OPTIONS
                       if options.get(key))
    endpoints: set[str] = set()
    for url in urls:
        endpoints.update(_endpoints(url, separate))
    return BrokerIdentity(shown, frozenset(endpoints))


def _read_urls(conf: Any) -> list[str]:
    """The URLs a worker consumes from, failover alternatives included (Celery's default
    when none is set)."""
    value = conf.get("broker_read_url") or conf.get("broker_url") or _CELERY_DEFAULT
    items: Iterable[str] = value.split(";") if isinstance(value, str) else value
    return list(dict.fromkeys(u.strip() for u in items if u and u.strip()))


def _endpoints(url: str, separate: str) -> Iterable[str]:
    parts = parse_url(url)
    scheme = str(parts["transport"]).lower()
    scheme = _SAME_PROTOCOL.get(scheme, scheme)
    if not parts["hostname"]:
        # In-process or local transports: the URL itself is all there is to compare.
        yield f"{_without_credentials(url)}{separate}"
        return
    port = parts["port"] or _DEFAULT_PORT.get(scheme, "")
    vhost = str(parts["virtual_host"] or "")
    if vhost in ("", "/"):
        vhost = _DEFAULT_VHOST.get(scheme, vhost)
    for host in _addresses(str(parts["hostname"])):
        yield f"{scheme}://{host}:{port}/{vhost}{separate}"


def _addresses(host: str) -> set[str]:
    """``host`` as written (lowercased) and the addresses it resolves to now."""
    found = {host.lower()}
    with contextlib.suppress(OSError, UnicodeError):  # unresolvable: compared by name alone
        found.update(str(info[4][0]) for info in socket.getaddrinfo(host, None))
    return found


def _without_credentials(url: str) -> str:
    if "://" not in url or "@" not in url.split("://", 1)[1].split("/", 1)[0]:
        return url
    scheme, rest = url.split("://", 1)
    netloc, _, path = rest.partition("/")
    return f"{scheme}://{netloc.rsplit('@', 1)[1]}/{path}" if path or rest.endswith("/") \
        else f"{scheme}://{netloc.rsplit('@', 1)[1]}"
