"""celery-resilient: Celery workers that come back from any restart without losing work."""

from .app import Resilient
from .config import ResilientConfig
from .context import Context, ContextStore
from .errors import (
    CheckpointError,
    ConfigurationError,
    ContextConflict,
    ContextNotFound,
    LedgerKeyError,
    ResilientError,
    SchemaError,
    SerializationError,
    StaleClaimError,
    StoreUnavailable,
    WorkDead,
    WorkKeyConflict,
    WorkStopped,
)
from .task import ResumableTask

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "Context",
    "ContextConflict",
    "ContextNotFound",
    "ContextStore",
    "LedgerKeyError",
    "Resilient",
    "ResilientConfig",
    "ResilientError",
    "ResumableTask",
    "SchemaError",
    "SerializationError",
    "StaleClaimError",
    "StoreUnavailable",
    "WorkDead",
    "WorkKeyConflict",
    "WorkStopped",
]
__version__ = "0.1.0.dev0"
