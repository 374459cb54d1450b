"""Which brokers a worker consumes through the reliable fetch (pure: no broker needed)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_resilient.broker import selection


def _conf(**settings: object) -> object:
    app = Celery("sel", set_as_current=False)
    app.conf.update(settings)
    return app.conf


@pytest.mark.parametrize(("url", "transport"), [
    ("redis://127.0.0.1:6379/0", "celery_resilient.broker.transport:Transport"),
    ("rediss://127.0.0.1:6380/0", "celery_resilient.broker.transport:Transport"),
    ("redis://a:6379/0;redis://b:6379/0", "celery_resilient.broker.transport:Transport"),
    ("sentinel://a:26379;sentinel://b:26379",
     "celery_resilient.broker.transport:SentinelTransport"),
])
def test_redis_brokers_get_the_reliable_fetch(url: str, transport: str) -> None:
    assert selection.choose(_conf(broker_url=url), True) == (transport, "on")


@pytest.mark.parametrize(("settings", "why"), [
    ({"broker_url": "amqp://guest@localhost//"}, "off (amqp:// needs none)"),
    ({"broker_url": "sqla+sqlite:///x.db"}, "off (sqla+sqlite:// needs none)"),
    ({"broker_url": "redis://x", "broker_transport": "my.own:Transport"},
     "off (broker_transport='my.own:Transport' is the user's)"),
    ({"broker_url": "redis://x", "broker_write_url": "amqp://y"},
     "off (the broker URLs mix schemes)"),
])
def test_other_brokers_and_a_users_transport_are_left_alone(settings: dict[str, object],
                                                            why: str) -> None:
    assert selection.choose(_conf(**settings), True) == (None, why)


def test_it_can_be_turned_off() -> None:
    assert selection.choose(_conf(broker_url="redis://x"), False) == (
        None, "off (resilient_reliable_fetch=False)")


def test_applying_it_keeps_kombus_tls_default_for_rediss() -> None:
    app = Celery("sel-tls", broker="rediss://127.0.0.1:6380/0", set_as_current=False)
    plain_ssl = app.connection_for_read().ssl
    assert plain_ssl, "kombu turns TLS on for rediss:// by itself"
    assert selection.apply(app, True) == "on"
    assert app.conf.broker_transport == selection.TRANSPORTS["rediss"]
    assert app.connection_for_read().ssl == plain_ssl
