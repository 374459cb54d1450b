"""Who this process is, for claims: node name, per-start incarnation id, PID.

The incarnation is minted in the worker's main process when it starts and inherited by
its forked pool processes, so every claim names the exact start that made it. A later start
of the same node knows at once that claims of any other incarnation are orphans.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass

#: The incarnation suffix of eager executions' claims (``task.apply()``, eager mode): no
#: worker's pool accounts for them, so they live by their own lease.
EAGER_SUFFIX = ":eager"


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: worker node name, per-start incarnation id, and process id."""

    node: str
    incarnation: str
    pid: int


_incarnation: str = uuid.uuid4().hex
_active: set[str] = set()
_active_lock = threading.Lock()


def new_incarnation() -> str:
    """Start a new incarnation (called once as the worker's main process boots)."""
    global _incarnation
    _incarnation = uuid.uuid4().hex
    return _incarnation


def incarnation() -> str:
    return _incarnation


def owner(node: str | None, eager: bool = False) -> Owner:
    """Who claims work in this process; eager executions claim as a separate owner whose
    claims live by their own lease (renewed by the worker while their process lives)."""
    return Owner(node or f"local@{socket.gethostname()}",
                 _incarnation + EAGER_SUFFIX if eager else _incarnation, os.getpid())


def enter(work_key: str) -> None:
    with _active_lock:
        _active.add(work_key)


def leave(work_key: str) -> None:
    with _active_lock:
        _active.discard(work_key)


def executing_here(work_key: str) -> bool:
    with _active_lock:
        return work_key in _active


def pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a running process on this host (a zombie awaiting reaping is not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return True  # no /proc: existence is all we know
    state = stat[stat.rfind(")") + 2:].split()[:1]
    return state not in (["Z"], ["X"])
