"""Under eventlet (``celery worker -P eventlet``) a store round trip must let the other green
threads run: psycopg waits in C unless told otherwise, and then one statement stopped the
whole process, the deadline watchdog that would end a call to a silent store included.

Each case runs in a process of its own, monkey-patched as Celery's eventlet pool does it
before anything else is imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import eventlet
    eventlet.monkey_patch()

    import json, sys, time
    from sqlalchemy import text
    from celery_resilient.store import deadlines
    from celery_resilient.store.sql import Store

    store = Store(sys.argv[1], sys.argv[2])
    ticks = []

    def ticker():
        while True:
            ticks.append(time.monotonic())
            eventlet.sleep(0.05)

    eventlet.spawn(ticker)
    eventlet.sleep(0.1)
    with store.single() as conn:
        before = len(ticks)
        conn.execute(text("SELECT pg_sleep(1)"))
        during = len(ticks) - before
    began = time.monotonic()
    outcome = "answered"
    try:
        with deadlines.bounded(0.5), store.single() as conn:
            conn.execute(text("SELECT pg_sleep(4)"))  # past its deadline
    except Exception as exc:
        outcome = type(exc).__name__
    print(json.dumps({"ticks": during, "outcome": outcome,
                      "seconds": time.monotonic() - began}))
    store.dispose()
""")


def test_a_round_trip_under_eventlet_lets_other_green_threads_run(
        pg_url: str, table_prefix: str) -> None:
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT, pg_url, table_prefix],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ticks"] >= 10, result  # a tick every 50 ms through a 1 s statement
    # the watchdog, a green thread too, ended the call at its deadline
    assert result["outcome"] != "answered" and result["seconds"] < 2.5, result
