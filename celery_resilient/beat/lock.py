"""RedBeat's lock, kept by this beat: a prompt takeover from a dead holder, and renewals.

RedBeat takes its lock at ``beat_init`` and extends it each tick; a beat that loses it exits.
A SIGKILLed beat leaves its lock held until it expires. So each beat records who holds the
lock (``<lock key>:holder``: the lock token and the holder's liveness identity: host, boot
id, PID namespace, PID, process start time), and a starting beat that finds the lock held
by a holder provably dead on this host deletes it at once (compare-and-delete on the token)
instead of waiting out the lock timeout. The lock is also extended in the middle of long
batches, and beat ticks often enough (a third of the lock timeout) that it never expires
while beat sleeps.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from celery import Celery
from redbeat.schedulers import get_redis

from celery_resilient.beat.entries import load_object
from celery_resilient.beat.log import log
from celery_resilient.core import liveness

DEFAULT_LOCK_TIMEOUT = 30.0  # when redbeat_lock_timeout is not set (RedBeat: 1500 s)
LOCK_POLL_SECONDS = 1.0

_CAS_DELETE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class LockHolder(Protocol):
    """What the keeper reads of the scheduler (RedBeat sets ``lock`` at ``beat_init``)."""

    app: Celery
    lock: Any
    lock_key: str | None
    lock_timeout: float
    max_interval: float


def default_timeout(max_interval: float) -> float:
    """The lock timeout when ``redbeat_lock_timeout`` is not set."""
    return min(float(max_interval) * 5, DEFAULT_LOCK_TIMEOUT)


class LockKeeper:
    """Takes over a dead holder's lock, records this beat as the holder, keeps the lock."""

    def __init__(self, scheduler: LockHolder, identity: str) -> None:
        self.scheduler = scheduler
        self.identity = identity

    @property
    def holder_key(self) -> str:
        return f"{self.scheduler.lock_key}:holder"

    def token(self) -> str | None:
        """The token of the lock this beat holds (None: no lock, or not taken yet)."""
        token = getattr(getattr(self.scheduler.lock, "local", None), "token", None)
        if isinstance(token, bytes):
            return token.decode()
        return None if token is None else str(token)

    def keep_at_tick(self) -> None:
        """Extend the lock as RedBeat does each tick (a lost lock ends beat); record us."""
        s = self.scheduler
        if s.lock_key:
            s.lock.extend(int(s.lock_timeout))
            self.publish_holder()

    def keep(self) -> None:
        """Extend RedBeat's lock mid-batch; a lost lock raises, and beat stops sending."""
        s = self.scheduler
        if s.lock_key and s.lock is not None:
            s.lock.extend(int(s.lock_timeout))

    def tick_cap(self) -> float:
        """Tick often enough that the lock never expires while beat sleeps."""
        s = self.scheduler
        if s.lock_key:
            return max(0.1, float(s.lock_timeout) / 3)
        return float(s.max_interval)

    def await_free(self) -> None:
        """Wait until RedBeat's lock is free; free it at once if its holder is provably dead.

        Runs before RedBeat acquires the lock (``beat_init``), so RedBeat's own acquisition
        never sits behind a dead predecessor's lock.
        """
        s = self.scheduler
        client = get_redis(s.app)
        waiting = False
        while True:
            token = client.get(s.lock_key)
            if token is None:
                return
            holder = load_object(client.get(self.holder_key))
            if (holder.get("token") == token and liveness.is_dead(holder.get("identity"))):
                if client.eval(_CAS_DELETE, 1, s.lock_key, token):
                    log.warning("beat: lock %s held by dead beat %s: taken over", s.lock_key,
                                holder.get("identity"),
                                extra={"action": "lock_takeover", "previous": holder})
                    return
                continue
            if not waiting:
                log.info("beat: waiting for lock %s held by %s", s.lock_key,
                         holder.get("identity", "an unknown beat"),
                         extra={"action": "lock_wait"})
                waiting = True
            time.sleep(min(LOCK_POLL_SECONDS, float(s.max_interval)))

    def publish_holder(self) -> None:
        """Record this beat as the lock's holder, for as long as the lock lasts."""
        token = self.token()
        if token:
            get_redis(self.scheduler.app).set(
                self.holder_key, json.dumps({"token": token, "identity": self.identity}),
                px=int(self.scheduler.lock_timeout * 1000))

    def forget_holder(self) -> None:
        """At close: remove the holder record of a lock this beat still holds."""
        s = self.scheduler
        if s.lock_key and s.lock is not None:
            try:
                if s.lock.owned():
                    get_redis(s.app).delete(self.holder_key)
            except Exception:  # closing: Redis may be gone; the record expires anyway
                log.debug("beat: could not remove lock holder record", exc_info=True)


__all__ = ["DEFAULT_LOCK_TIMEOUT", "LOCK_POLL_SECONDS", "LockHolder", "LockKeeper",
           "default_timeout"]
