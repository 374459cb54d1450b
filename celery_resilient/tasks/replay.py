"""Reporting an ended request to Celery again when its first report died half-way.

Celery ends a request in one call of its result backend, ``mark_as_done`` or
``mark_as_failure``: it stores SUCCESS (FAILURE), then counts the request as a part of its
chord (``on_chord_part_return``, the count that fires the chord's body), and on a failure
marks the rest of its chain failed and calls its errbacks. A SIGKILL inside that call leaves
the state stored and the rest undone: a chord that waits for ever, an errback never run. A
redelivered copy that finds the state already stored cannot tell how far the call got, so it
makes the call again, where making it twice does each thing once:

- storing the same state again changes nothing, nor does failing the chain again;
- errbacks run again, as they would on plain Celery, whose copy runs the body and fails
  again: once if the kill came before them, twice if it came after (the window between the
  errbacks and the acknowledgement, docs/guarantees.md);
- the chord part is counted again only by a backend that counts a part once however often
  it is reported: Celery 5.7's Redis backend (each part is recorded under its task id and
  header index, a finished chord is marked done), and backends whose chords poll the
  header's results (``celery.chord_unlock``: the database backend) and count nothing. Older
  Redis backends and the key-value backends would count a replay twice: the copy leaves the
  part alone and logs that the chord may wait.

Chain links and ``link`` callbacks of a success went out before SUCCESS was stored (Celery
sends them first), so a success is not reported through the task's callbacks again.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from celery import states

log = logging.getLogger(__name__)


def counts_each_part_once(backend: Any) -> bool:
    """Whether ``backend`` counts a chord part reported twice once (Celery 5.7+'s Redis)."""
    return hasattr(backend, "_chord_part_return_script")


def counts_parts(backend: Any) -> bool:
    """Whether a chord's body waits on ``backend``'s count rather than on ``chord_unlock``."""
    return bool(getattr(backend, "supports_native_join", False))


def report_again(backend: Any, request: Any, state: str, result: Any) -> None:
    """Make what is left of Celery's end-of-request call for ``request`` (a task's request
    context) again, with ``result`` (the stored return value, or the rebuilt exception). A
    backend that fails now is logged: the message is acknowledged either way."""
    try:
        _report_again(backend, request, state, result)
    except Exception as exc:
        log.warning("request %s not reported again (%s: %s)", request.id,
                    type(exc).__name__, exc)


def _report_again(backend: Any, request: Any, state: str, result: Any) -> None:
    in_chord = bool(getattr(request, "chord", None) and getattr(request, "group", None))
    count = in_chord and (not counts_parts(backend) or counts_each_part_once(backend))
    if in_chord and not count:
        log.warning("chord part %s of group %s not counted again: %s would count a replay "
                    "twice, so a kill between its %s and the count leaves the chord "
                    "waiting", request.id, request.group, type(backend).__name__, state)
    again = ["its chord part counted"] if count else []
    if state != states.SUCCESS:
        again.append("its chain failed and its errbacks run")
    log.info("request %s already %s in the result backend: %s", request.id, state,
             " again, ".join(again) + " again" if again else "nothing left to report",
             extra={"action": "report_replayed", "task_id": request.id})
    if state == states.SUCCESS:
        if count:  # storing SUCCESS again would drop the children the first run recorded
            backend.on_chord_part_return(request, state, result)
        return
    if not count:
        request = copy.copy(request)
        request.chord = None
    meta = backend.get_task_meta(request.id)  # store it again as it is, traceback and all
    backend.mark_as_failure(request.id, result, traceback=meta.get("traceback"),
                            request=request)
