"""Which brokers a worker consumes through the reliable fetch (pure: no broker needed)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_resilient.broker import link, selection


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


def test_a_redis_link_gets_timeouts_and_keepalives_unless_set() -> None:
    conf = _conf(broker_url="redis://x", broker_transport_options={"visibility_timeout": 7})
    phrase, warnings = link.apply(conf)
    options = conf.broker_transport_options
    assert options["visibility_timeout"] == 7 and options["socket_timeout"] == 10.0
    assert options["socket_keepalive"] is True and options["socket_keepalive_options"]
    assert warnings == [] and "socket_timeout=10.0s" in phrase


def test_a_users_own_unbounded_setting_is_kept_and_named() -> None:
    conf = _conf(broker_url="redis://x", broker_transport_options={"socket_timeout": None})
    _, warnings = link.apply(conf)
    assert conf.broker_transport_options["socket_timeout"] is None
    assert len(warnings) == 1 and "broker_transport_options['socket_timeout']=None" in warnings[0]


def test_amqp_gets_short_heartbeats_unless_the_user_chose() -> None:
    conf = _conf(broker_url="amqp://guest@localhost//")
    assert link.apply(conf)[0].startswith("heartbeat=10s") and conf.broker_heartbeat == 10
    mine = _conf(broker_url="amqp://guest@localhost//", broker_heartbeat=0)
    _, warnings = link.apply(mine)
    assert mine.broker_heartbeat == 0 and "broker_heartbeat=0" in warnings[0]
    chosen = _conf(broker_url="amqp://guest@localhost//", broker_heartbeat=60)
    assert link.apply(chosen) == ("heartbeat=60s channel_error_retry=on", [])


def test_amqp_reopens_a_closed_channel_unless_the_user_chose() -> None:
    """A channel RabbitMQ closes for its consumer_timeout ends a plain Celery worker."""
    conf = _conf(broker_url="amqp://guest@localhost//")
    assert "channel_error_retry=on" in link.apply(conf)[0]
    assert conf.broker_channel_error_retry is True
    mine = _conf(broker_url="amqp://guest@localhost//", broker_channel_error_retry=False)
    phrase, warnings = link.apply(mine)
    assert mine.broker_channel_error_retry is False and "channel_error_retry=off" in phrase
    assert len(warnings) == 1 and "broker_channel_error_retry=False" in warnings[0]
