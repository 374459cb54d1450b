"""A consumer process for the reliable-fetch tests and benchmark.

``python -m tests.integration.fetch_consumer URL QUEUE TRANSPORT [DONE_LOG]`` consumes QUEUE
through TRANSPORT ("reliable": celery_resilient.broker.transport, "kombu": kombu's own) and
prints ``incarnation <id>`` once and ``got <body>`` per message. Without DONE_LOG it holds
every message until killed (a worker's prefetch). With DONE_LOG it appends each body to that
file and then acknowledges it, fetching on as a busy worker does; a message is then in its
queue, in ``unacked``, in DONE_LOG (both, if killed between the two), or lost.
"""

from __future__ import annotations

import sys
from typing import Any

from kombu import Connection, Consumer, Exchange, Queue

from celery_resilient.core import identity

TRANSPORTS = {"reliable": "celery_resilient.broker.transport:Transport", "kombu": None}


def main(url: str, queue_name: str, transport: str, done_log: str | None = None) -> None:
    queue = Queue(queue_name, Exchange(queue_name, type="direct"), routing_key=queue_name)
    print(f"incarnation {identity.incarnation()}", flush=True)
    done = open(done_log, "a", buffering=1) if done_log else None  # noqa: SIM115

    def on_message(body: Any, message: Any) -> None:
        if done is not None:
            done.write(f"{body}\n")  # a line the OS keeps when this process is killed
            message.ack()
        print(f"got {body}", flush=True)

    with Connection(url, transport=TRANSPORTS[transport]) as conn, Consumer(
            conn, [queue], callbacks=[on_message], prefetch_count=1000):
        while True:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                continue


if __name__ == "__main__":
    main(*sys.argv[1:])
