"""Every library exception survives pickling (Celery pickles task errors) with its args."""

from __future__ import annotations

import inspect
import pickle

import pytest

from celery_resilient import errors

CLASSES = [obj for _, obj in inspect.getmembers(errors, inspect.isclass)
           if issubclass(obj, BaseException) and obj.__module__ == errors.__name__]


def test_the_module_defines_the_expected_exceptions() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"ResilientError", "ConfigurationError", "StoreUnavailable", "SchemaError",
            "StaleClaimError", "CheckpointError", "SerializationError", "WorkKeyConflict",
            "LedgerKeyError", "ContextNotFound", "ContextConflict", "WorkDead",
            "WorkStopped", "NotRunning"} <= names


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_one_base(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.ResilientError)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("args", [(), ("what went wrong",), ("message", 42, {"k": "v"})],
                         ids=["no-args", "message", "several"])
def test_picklable_with_args_preserved(cls: type[Exception], args: tuple[object, ...]) -> None:
    exc = cls(*args)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert back.args == exc.args
    assert str(back) == str(exc)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_default_message_is_the_docstring(cls: type[Exception]) -> None:
    assert cls.__doc__
    assert str(cls()) == cls.__doc__
    assert cls("custom").args == ("custom",)
