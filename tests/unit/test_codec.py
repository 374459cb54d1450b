"""codec: JSON in and out of the store, never pickle."""

from __future__ import annotations

import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest

from celery_resilient.core import codec
from celery_resilient.errors import ResilientError, SerializationError

VALUES: list[Any] = [
    None,
    True,
    0,
    -12,
    3.25,
    "text with ünïcode and \"quotes\"",
    [1, "two", None],
    {"nested": {"list": [1, 2, {"deep": True}]}},
    datetime(2026, 11, 30, 3, 10, 12, 123456, tzinfo=timezone.utc),
    datetime(2026, 11, 30, 3, 10, 12, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    datetime(2026, 11, 30, 3, 10, 12),
    date(2026, 2, 28),
    uuid.UUID("12345678-1234-5678-1234-567812345678"),
    Decimal("12345.678901234567890"),
    {"when": datetime(2026, 1, 1, tzinfo=timezone.utc), "id": uuid.uuid4(),
     "amount": Decimal("0.10"), "rows": [1, 2]},
]


@pytest.mark.parametrize("value", VALUES, ids=[type(v).__name__ + str(i) for i, v in
                                                 enumerate(VALUES)])
def test_round_trip(value: Any) -> None:
    text = codec.encode(value)
    assert isinstance(text, str)
    back = codec.decode(text)
    assert back == value
    assert type(back) is type(value)


def test_round_trip_keeps_the_types_inside_containers() -> None:
    value = {"at": datetime(2026, 1, 1, 12, tzinfo=timezone.utc), "price": Decimal("9.99"),
             "ref": uuid.UUID(int=7)}
    back = codec.decode(codec.encode(value))
    assert isinstance(back["at"], datetime) and back["at"].tzinfo is not None
    assert isinstance(back["price"], Decimal)
    assert isinstance(back["ref"], uuid.UUID)


def test_decode_none_is_none() -> None:
    assert codec.decode(None) is None


class Opaque:
    pass


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (Opaque(), "Opaque"),
        ({"rows": {1, 2}}, "set"),
        ({"fn": len}, "builtin_function_or_method"),
        ({(1, 2): "tuple key"}, "keys must be"),
    ],
)
def test_non_serialisable_names_what_and_why(value: Any, problem: str) -> None:
    with pytest.raises(SerializationError) as info:
        codec.encode(value, "checkpoint state")
    message = str(info.value)
    assert message.startswith("checkpoint state is not JSON-serialisable")
    assert problem in message
    assert isinstance(info.value, ResilientError)


def test_circular_structure_is_a_serialization_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(SerializationError, match="Circular reference"):
        codec.encode(loop, "state")


def test_never_pickles() -> None:
    assert "pickle" not in codec.encode({"a": Opaque.__name__})
    with pytest.raises(SerializationError):
        codec.encode(Opaque())


def test_digest_is_canonical_and_discriminating() -> None:
    a = codec.digest([[1, 2], {"b": 1, "a": 2}])
    b = codec.digest([[1, 2], {"a": 2, "b": 1}])
    assert a == b  # key order does not matter
    assert len(a) == 64
    assert codec.digest([[1, 3], {"a": 2, "b": 1}]) != a
    assert codec.digest([[Decimal("1.5")], {}]) == codec.digest([[Decimal("1.5")], {}])
    assert codec.digest([[Decimal("1.5")], {}]) != codec.digest([[Decimal("1.6")], {}])


def test_digest_of_unserialisable_arguments_is_a_serialization_error() -> None:
    with pytest.raises(SerializationError, match="task arguments"):
        codec.digest([[Opaque()], {}])
