"""The beat's own kill points: SIGKILL the beat right after a slot claim or a publish.

Test-only. Each point is armed by an environment variable whose value is a file path: when
the point is reached the beat creates the file (writing its PID) and SIGKILLs its own process
(not its process group). An existing file disarms the point, so a restarted beat with the same
environment runs on.

Why not :mod:`celery_resilient.core.killpoints`, the workers' kill points: it cannot serve
these without changing what the tests rely on.

- It kills the whole process group by default (``RESILIENT_KILL_SCOPE=process`` is needed
  otherwise). ``tests/integration/test_beat_catchup_batch.py`` runs the beat with
  ``subprocess.run`` in pytest's own process group: a group kill would kill the test run.
- It is armed by one variable, ``RESILIENT_KILL_AT``, naming points of its fixed list, read
  once at import; the beat's points are armed each by a variable of its own that *is* the
  file that disarms it. Without ``RESILIENT_KILL_ONCE`` core fires again after a restart;
  the beat's points never do.
- Its ``<nth>`` counts every time a point is reached; the beat's publish point counts only
  while it is armed, across first sends and re-sends alike.
"""

from __future__ import annotations

import os
import signal

#: A file path; after the first slot claim commits, the beat creates the file and SIGKILLs
#: itself (once: an existing file disarms it).
KILL_AFTER_CLAIM_ENV = "RESILIENT_BEAT_KILL_AFTER_CLAIM"
#: A file path; after the ``KILL_AFTER_PUBLISH_NTH_ENV``-th (default 1st) slot published by
#: this process, before it is recorded sent, the beat creates the file and SIGKILLs itself
#: (once: an existing file disarms it).
KILL_AFTER_PUBLISH_ENV = "RESILIENT_BEAT_KILL_AFTER_PUBLISH"
KILL_AFTER_PUBLISH_NTH_ENV = "RESILIENT_BEAT_KILL_AFTER_PUBLISH_NTH"

_published = 0  # slots published by this process while the publish point was armed


def after_claim() -> None:
    """A slot claim committed, nothing of it published yet."""
    _die(os.environ.get(KILL_AFTER_CLAIM_ENV))


def after_publish() -> None:
    """A slot was published and is not yet recorded sent."""
    global _published
    path = os.environ.get(KILL_AFTER_PUBLISH_ENV)
    if not path:
        return
    _published += 1
    if _published == int(os.environ.get(KILL_AFTER_PUBLISH_NTH_ENV) or 1):
        _die(path)


def _die(path: str | None) -> None:
    """SIGKILL this process unless ``path`` is unset or exists; create it first."""
    if path and not os.path.exists(path):
        with open(path, "w") as fh:
            fh.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["KILL_AFTER_CLAIM_ENV", "KILL_AFTER_PUBLISH_ENV", "KILL_AFTER_PUBLISH_NTH_ENV",
           "after_claim", "after_publish"]
