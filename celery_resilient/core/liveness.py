"""Who a process is, and whether a recorded process is provably dead.

A worker incarnation records this identity in its ``workers`` row; a beat records it next to
RedBeat's lock and on every slot it claims. A successor on the same host (same kernel boot,
same PID namespace) can then prove its predecessor dead from ``/proc`` and take over at once
instead of waiting for a lease or lock to expire. Anything it cannot prove counts as alive:
another host, another PID namespace, or another boot id under the same host name (two
machines or containers sharing a name). Waiting for the lease is safe; a takeover is not.
"""

from __future__ import annotations

import os
import socket
import uuid
from functools import lru_cache

from celery_resilient.core.identity import pid_alive

SEP = "|"


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _boot_id() -> str:
    return _read("/proc/sys/kernel/random/boot_id")[:8] or "noboot"


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "nons"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if no such process."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        if os.path.isdir("/proc/self"):
            return None
        return "" if pid_alive(pid) else None  # no /proc: only existence is known
    fields = stat[stat.rfind(")") + 2:].split()
    if fields and fields[0] in ("Z", "X"):
        return None  # a zombie waiting to be reaped is as dead as it gets
    return fields[19] if len(fields) > 19 else ""


@lru_cache(maxsize=1)
def _current(pid: int) -> str:
    parts = [socket.gethostname(), _boot_id(), _pid_namespace(), str(pid),
             _start_time(pid) or "", uuid.uuid4().hex[:8]]
    return SEP.join(p.replace(SEP, "_") for p in parts)


def current() -> str:
    """This process: host, boot, PID namespace, PID, start time, and a random tag."""
    return _current(os.getpid())


def is_dead(identity: str | None) -> bool:
    """True only when the process ``identity`` names is provably gone."""
    if not identity:
        return False
    parts = identity.split(SEP)
    if len(parts) != 6:
        return False
    host, boot, pidns, pid_text, started, _tag = parts
    if host != socket.gethostname():
        return False
    if boot != _boot_id() or pidns != _pid_namespace() or not pid_text.isdigit():
        # A reboot and a second machine with the same host name look alike: only the
        # holder's own lease or lock expiry can tell them apart.
        return False
    if identity == current():
        return False
    now_started = _start_time(int(pid_text))
    if now_started is None:
        return True
    return bool(started) and bool(now_started) and now_started != started


def is_alive(identity: str | None) -> bool:
    """True only when the process ``identity`` names provably runs (this host, boot and PID
    namespace, the same PID with the same start time)."""
    if not identity:
        return False
    parts = identity.split(SEP)
    if len(parts) != 6:
        return False
    host, boot, pidns, pid_text, started, _tag = parts
    if (host != socket.gethostname() or boot != _boot_id() or pidns != _pid_namespace()
            or not pid_text.isdigit() or not started):
        return False
    return _start_time(int(pid_text)) == started
