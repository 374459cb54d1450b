"""Every exception the library raises, under one base.

Each class's docstring is its default message. Constructor arguments equal ``args`` so the
exceptions survive Celery's pickling of task errors.
"""

from __future__ import annotations


class ResilientError(Exception):
    """celery-resilient error."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or (self.__doc__ or "",)))


class ConfigurationError(ResilientError):
    """Invalid celery-resilient setting."""


class StoreUnavailable(ResilientError):
    """The durable store cannot be reached; the work is retried, not lost."""


class StoreUnreachable(StoreUnavailable):
    """The store cannot be reached at all (refused, lost, or silent past its deadline), as
    opposed to a transient conflict it answered with: the worker pauses its intake at once."""


class SchemaError(ResilientError):
    """The store's schema is missing or out of date."""


class StaleClaimError(ResilientError):
    """This execution's claim was taken over by a newer one; its writes are refused."""


class WorkStopped(StaleClaimError):
    """The work was cancelled or revoked while it ran; this execution's writes are refused."""


class WorkDead(ResilientError):
    """The work died with its worker too many times, or was re-published too often, and is
    parked as ``dead``."""


class CheckpointError(ResilientError):
    """The checkpoint state cannot be stored; the previous checkpoint is unchanged."""


class SerializationError(ResilientError):
    """A value cannot be stored as JSON."""


class PayloadTooLarge(ResilientError, ValueError):
    """A statement carrying a value (a result, a step's or a ledger effect's result, a
    checkpoint, a context or a task's message) is larger than the store's server accepts."""


class WorkKeyConflict(ResilientError):
    """The same work key was sent with different arguments."""


class LedgerKeyError(ResilientError):
    """Invalid ledger key."""


class ContextNotFound(ResilientError):
    """No context is stored under this key."""


class ContextConflict(ResilientError):
    """The context was changed by someone else since it was read."""


class ScheduleError(ResilientError):
    """Invalid schedule entry."""


class NotRunning(ResilientError, AttributeError):
    """A task's work key, checkpoint, steps or ledger were used outside a run of the task.

    Also an ``AttributeError``, as for any attribute a task does not have now, so
    ``hasattr(task, "checkpoint")`` and ``inspect.getmembers(task)`` answer instead of
    raising."""
