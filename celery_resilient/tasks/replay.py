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

Celery 5.7's Redis backend claims the right to send a chord's body (a key that expires)
before it sends it. A dispatcher killed in between leaves the claim to expire and no one to
send the body: the copy waits for the claim to go and counts its part again, which claims
and sends the body (a body that was sent leaves a ``done`` marker instead, and nothing is
sent twice).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

from celery import states

log = logging.getLogger(__name__)


def counts_each_part_once(backend: Any) -> bool:
    """Whether ``backend`` counts a chord part reported twice once (Celery 5.7+'s Redis)."""
    return hasattr(backend, "_chord_part_return_script")


def counts_parts(backend: Any) -> bool:
    """Whether a chord's body waits on ``backend``'s count rather than on ``chord_unlock``."""
    return bool(getattr(backend, "supports_native_join", False))


#: The longest a copy waits for a chord-body claim of a killed dispatcher to expire (Celery
#: 5.7 claims for ``2 * result_chord_join_timeout``, at least 5 s; 10 s by default).
DISPATCH_CLAIM_WAIT = 60.0


def report_again(backend: Any, request: Any, state: str, result: Any,
                 wait_for_dispatch: bool = False) -> None:
    """Make what is left of Celery's end-of-request call for ``request`` (a task's request
    context) again, with ``result`` (the stored return value, or the rebuilt exception). A
    backend that fails now is logged: the message is acknowledged either way.

    ``wait_for_dispatch``: when the chord's body is claimed by a dispatcher that may have
    died, wait for the claim to end and count again (a pool process may wait; the worker's
    main process must not)."""
    try:
        _report_again(backend, request, state, result)
        if wait_for_dispatch and _in_chord(request) and counts_each_part_once(backend):
            _finish_stranded_dispatch(backend, request, state, result)
    except Exception as exc:
        log.warning("request %s not reported again (%s: %s)", request.id,
                    type(exc).__name__, exc)


def finish_dispatch_later(backend: Any, request: Any, state: str, result: Any) -> None:
    """The wait of ``report_again(wait_for_dispatch=True)`` in a thread of its own: for the
    worker's main process, which counts the part of a pool process lost after SUCCESS (no
    copy comes back: Celery acknowledges it) and must not block its event loop."""
    if not (_in_chord(request) and counts_each_part_once(backend)):
        return

    def finish() -> None:
        try:
            _finish_stranded_dispatch(backend, request, state, result)
        except Exception as exc:
            log.warning("chord %s: body dispatch not finished (%s: %s)", request.group,
                        type(exc).__name__, exc)

    threading.Thread(target=finish, name=f"chord-dispatch-{request.group}", daemon=True).start()


def _in_chord(request: Any) -> bool:
    return bool(getattr(request, "chord", None) and getattr(request, "group", None))


def _finish_stranded_dispatch(backend: Any, request: Any, state: str, result: Any) -> None:
    claim_key = backend.get_key_for_group(request.group, ".c")
    size_key = backend.get_key_for_group(request.group, ".s")
    deadline = time.monotonic() + DISPATCH_CLAIM_WAIT
    while True:
        if not backend.client.exists(size_key):
            return  # the chord ended (its body sent, or it failed) or expired
        claim = backend.client.get(claim_key)
        if claim is None:
            break  # no dispatcher (the count is not complete), or its claim expired
        if claim == b"done":
            return  # the body was sent
        if time.monotonic() >= deadline:
            log.warning("chord %s: its body is still claimed by a dispatcher after %.0fs; "
                        "not waiting longer", request.group, DISPATCH_CLAIM_WAIT)
            return
        time.sleep(0.2)
    log.info("chord %s: no dispatcher holds its body; counting part %s again", request.group,
             request.id, extra={"action": "report_replayed", "task_id": request.id})
    backend.on_chord_part_return(request, state, result)


def _report_again(backend: Any, request: Any, state: str, result: Any) -> None:
    in_chord = _in_chord(request)
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
