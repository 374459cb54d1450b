"""celery-resilient: Celery workers that come back from any restart without losing work."""

from celery_resilient.app import Resilient
from celery_resilient.errors import (
    CheckpointError,
    ConfigurationError,
    ContextConflict,
    ContextNotFound,
    LedgerKeyError,
    PayloadTooLarge,
    ResilientError,
    SchemaError,
    SerializationError,
    StaleClaimError,
    StoreUnavailable,
    StoreUnreachable,
    WorkDead,
    WorkKeyConflict,
    WorkStopped,
)
from celery_resilient.runtime.config import ResilientConfig
from celery_resilient.tasks.context import Context, ContextStore
from celery_resilient.tasks.task import ResumableTask

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "Context",
    "ContextConflict",
    "ContextNotFound",
    "ContextStore",
    "LedgerKeyError",
    "PayloadTooLarge",
    "Resilient",
    "ResilientConfig",
    "ResilientError",
    "ResumableTask",
    "SchemaError",
    "SerializationError",
    "StaleClaimError",
    "StoreUnavailable",
    "StoreUnreachable",
    "WorkDead",
    "WorkKeyConflict",
    "WorkStopped",
]
__version__ = "0.1.0.dev0"
