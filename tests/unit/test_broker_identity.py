"""How workers compare brokers: one broker however it is addressed, another when the
server, port, database, virtual host or key prefix differs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from celery import Celery

from celery_resilient.broker.identity import BrokerIdentity, of_app


def _identity(url: str, name: str | None = None, **options: Any) -> BrokerIdentity:
    app = Celery(broker=url)
    app.conf.broker_transport_options = options
    return of_app(app, name)


@pytest.mark.parametrize(("a", "b"), [
    ("redis://localhost:6379", "redis://127.0.0.1:6379/0"),
    ("redis://:secret@127.0.0.1:6379/2", "redis://127.0.0.1/2"),
    ("amqp://guest:guest@localhost//", "pyamqp://other@127.0.0.1:5672//"),
    ("redis://10.9.9.9:6379/0;redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_one_broker_however_addressed(a: str, b: str) -> None:
    assert _identity(a).same_broker(_identity(b))


@pytest.mark.parametrize(("a", "b"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0"),
    ("redis://127.0.0.1:6379/0", "amqp://guest:guest@127.0.0.1:5672//"),
    ("amqp://guest:guest@127.0.0.1:5672//", "amqp://guest:guest@127.0.0.1:5672/other"),
])
def test_different_brokers_differ(a: str, b: str) -> None:
    assert not _identity(a).same_broker(_identity(b))


def test_a_key_prefix_makes_one_redis_two_brokers() -> None:
    plain = _identity("redis://127.0.0.1:6379/0")
    prefixed = _identity("redis://127.0.0.1:6379/0", global_keyprefix="app2:")
    assert not plain.same_broker(prefixed)
    assert prefixed.same_broker(_identity("redis://localhost:6379", global_keyprefix="app2:"))


def test_a_broker_name_replaces_the_addresses() -> None:
    a = _identity("redis://10.0.0.1:6379/0", name="main")
    b = _identity("redis://192.168.1.1:6379/0", name="main")
    assert a.same_broker(b)
    assert not a.same_broker(_identity("redis://10.0.0.1:6379/0"))
    assert "main" in a.shown and "10.0.0.1" in a.shown


def test_what_is_shown_carries_no_credentials_and_round_trips() -> None:
    ident = _identity("amqp://user:hunter2@127.0.0.1:5672/vh")
    assert "hunter2" not in ident.shown and "hunter2" not in ident.dumps()
    assert ident.shown == "amqp://127.0.0.1:5672/vh"
    assert BrokerIdentity.loads(ident.dumps()) == ident


@pytest.mark.parametrize("text", ["", "not json", "{}", '{"shown": "x"}', "[1, 2]"])
def test_an_unreadable_record_is_not_judged(text: str) -> None:
    assert BrokerIdentity.loads(text) is None


def test_addresses_that_do_not_meet_are_one_broker_by_its_token() -> None:
    here = replace(_identity("redis://127.0.0.1:6379/0"), token="token-1")
    there = replace(_identity("redis://10.1.2.3:6379/0"), token="token-1")
    assert here.same_broker(there)
    assert not here.same_broker(replace(there, token="token-2"))
    assert not here.same_broker(replace(there, token=None))
    assert not replace(here, token=None).same_broker(replace(there, token=None))
    assert BrokerIdentity.loads(here.dumps()) == here
