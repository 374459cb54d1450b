"""RabbitMQ's consumer timeout on long resumable tasks, library defaults, a real worker.

RabbitMQ closes a channel (PRECONDITION_FAILED) when a delivery stays unacknowledged longer
than its ``consumer_timeout``: an ``acks_late`` task running longer than it, or the messages
prefetched behind it. Each test runs a RabbitMQ node of its own
(``celery_resilient.testing.rabbitmq_node.ThrowawayRabbitMQ``) with an 8 s consumer timeout
checked every second, and one ``celery worker -c 2`` of ``tests/e2e/proj.py`` on PostgreSQL
with the library's defaults (``ingest``: a checkpoint every 2.5 s for 25 s, then a step and a
ledger effect; ``short``: one effect).

- **Closes are survived**: three long tasks and six short ones queued behind them. The
  worker never exits; each long body starts once, from no checkpoint, every row, step and
  ledger effect once, each short once; the broker closed the channel at least once and the
  worker acknowledged the redelivered copies of its running tasks without running them; at
  the end nothing is left ready or unacknowledged, and over a window longer than the
  consumer timeout nothing changes.
- **A pool process killed after a close**: two long tasks and six short ones; once the
  copies of both running long tasks are settled, the pool process of one is SIGKILLed. No
  message of it is left in the broker (the copy was acknowledged, the original's reject is
  only recorded): the main process hears of the death and its batched takes clear the
  claim's owner (without batched takes the reconcile does: the pool process is gone), and
  the next sweep re-publishes it from the store, within 15 s (the bound is one sweep
  interval, 5 s); it resumes from its last checkpoint, ends once, no step applied twice (the
  figures are printed).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest

from celery_resilient.core import codec
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.rabbitmq_node import ThrowawayRabbitMQ

from .conftest import Project

CONSUMER_TIMEOUT = 8.0
ROWS = 10
DELAY = 2.5  # a long task: 25 s, checkpointing every 2.5 s
SHORTS = 6
#: RabbitMQ's log line for each channel it closed at the consumer timeout.
CLOSED = re.compile(r"precondition_failed: delivery acknowledgement on channel \d+ timed out")
#: The worker's log line for each redelivered copy of a request executing there.
SETTLED = re.compile(r"tests\.e2e\.proj\.ingest\[([\w-]+)\]: redelivered while it runs here")


@pytest.fixture
def rabbit() -> Iterator[ThrowawayRabbitMQ]:
    """A RabbitMQ node of the test's own with an 8 s consumer timeout."""
    node = ThrowawayRabbitMQ(consumer_timeout=CONSUMER_TIMEOUT)
    try:
        node.start()
        yield node
    finally:
        node.destroy()


class Run:
    """One worker of ``proj`` on the throwaway node, and the witnesses of its run."""

    def __init__(self, project: Project, rabbit: ThrowawayRabbitMQ, effects: EffectLog) -> None:
        self.project = project
        self.rabbit = rabbit
        self.effects = effects
        self.worker: LocalWorker = project.worker(concurrency=2)

    def send(self, long: int, short: int) -> tuple[list[str], list[str]]:
        longs = [self.project.send("ingest", ROWS, DELAY, task_id=f"long-{i}")
                 for i in range(long)]
        shorts = [self.project.send("short", i, task_id=f"short-{i}") for i in range(short)]
        return longs, shorts

    def alive(self) -> None:
        assert self.worker.process.status == "running", (
            f"the worker exited\n{self.report()}")

    def wait(self, condition: Callable[[], object], timeout: float, what: str) -> None:
        """Wait for ``condition``; the worker must stay alive all along."""
        def check() -> object:
            self.alive()
            return condition()

        try:
            wait_for(check, timeout, what, interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.report()}") from None

    def closes(self) -> int:
        return len(CLOSED.findall(self.rabbit.log_text()))

    def settled(self) -> list[str]:
        return SETTLED.findall(self.worker.process.all_logs())

    def queue(self) -> tuple[int, int]:
        """(ready, unacknowledged) of the test's queue."""
        return self.rabbit.queue_counts(self.project.queue)

    def unacked_anywhere(self) -> int:
        return sum(unacked for _, unacked in self.rabbit.queues().values())

    def done(self, keys: list[str]) -> bool:
        return self.project.all_done(keys)

    def checkpointed(self, key: str) -> int:
        found = self.project.store.load_checkpoint(key)
        return 0 if found is None else int(codec.decode(found[0])["row"])

    def starts(self, key: str) -> list[dict[str, object]]:
        return self.effects.entries(f"start:{key}")

    def report(self) -> str:
        keys = sorted({e["effect"].split(":")[1] for e in self.effects.entries()
                       if e["effect"].startswith(("start:", "short:"))})
        states = {k: self.project.state(k) for k in keys}
        return (f"store: {states}\nchannel closes: {self.closes()}, copies settled: "
                f"{self.settled()}\nworker log:\n{self.worker.process.all_logs()[-8000:]}")


def _effect_names(longs: list[str], shorts: list[str]) -> set[str]:
    names = {f"short:{k}" for k in shorts}
    for k in longs:
        names |= {f"start:{k}", f"notify:{k}", f"charge:{k}"}
        names |= {f"row:{k}:{i}" for i in range(ROWS)}
    return names


def test_consumer_timeout_closes_are_survived(rabbit: ThrowawayRabbitMQ,
                                              make_project: Callable[..., Project],
                                              effect_log: EffectLog) -> None:
    run = Run(make_project(rabbit.url), rabbit, effect_log)
    sent_at = time.monotonic()
    longs, shorts = run.send(3, SHORTS)
    run.wait(lambda: run.done(longs + shorts), 80, "all 9 works done")
    elapsed = time.monotonic() - sent_at
    run.wait(lambda: run.queue() == (0, 0) and run.unacked_anywhere() == 0, 15,
             "nothing ready or unacknowledged in the broker")

    effect_log.assert_exactly_once(_effect_names(longs, shorts))
    for key in longs:
        assert [s["row"] for s in run.starts(key)] == [0], f"{key} resumed or restarted"
        row = run.project.store.get_work(key)
        # (its epoch counts takes: a prefetched request taken and dropped at a close counts)
        assert row is not None and row.state == "done" and row.deaths == 0, row
    closes, settled = run.closes(), run.settled()
    assert closes >= 1, f"the broker never closed a channel: the test proved nothing\n" \
                        f"{run.report()}"
    assert settled and set(settled) <= set(longs), run.report()

    # Longer than the consumer timeout: a delivery the worker still held unacknowledged
    # would close the channel again; nothing may run again or change.
    before = effect_log.counts()
    window = CONSUMER_TIMEOUT + 3

    def changed() -> str:
        run.alive()
        problems = []
        if effect_log.counts() != before:
            problems.append("effects changed")
        if run.closes() != closes:
            problems.append("the channel was closed again")
        if not run.done(longs + shorts):
            problems.append("a work left done")
        return ", ".join(problems)

    try:
        found = wait_for(changed, window, "a change after all ended", interval=0.2)
    except AssertionError:
        found = ""
    assert not found, f"{found}\n{run.report()}"
    assert run.queue() == (0, 0) and run.unacked_anywhere() == 0
    print(f"all 9 done {elapsed:.1f}s after the sends; channel closes {closes}; copies "
          f"settled {len(settled)} ({sorted(settled)}); executions per long task "
          f"{[len(run.starts(k)) for k in longs]}")


def test_pool_process_killed_after_a_close_resumes_from_checkpoint(
        rabbit: ThrowawayRabbitMQ, make_project: Callable[..., Project],
        effect_log: EffectLog) -> None:
    run = Run(make_project(rabbit.url), rabbit, effect_log)
    sent_at = time.monotonic()
    longs, shorts = run.send(2, SHORTS)

    # The first close: the copies of both running long tasks are settled by the worker.
    run.wait(lambda: set(run.settled()) >= set(longs), 40,
             "the redelivered copies of both running long tasks settled")
    victim = longs[0]
    starts = run.starts(victim)
    assert len(starts) == 1, starts
    pid = int(str(starts[0]["pid"]))
    assert pid in run.worker.process.children(), (pid, run.worker.process.children())
    assert run.project.state(victim) == "running"
    run.wait(lambda: run.checkpointed(victim) >= 1, 20, f"a checkpoint of {victim}")
    run.worker.kill_pool_child(pid)
    killed_at = time.monotonic()
    saved = run.checkpointed(victim)

    republished = f"re-published orphaned work {victim}"
    # its claim has no owner now: the next sweep (every 5 s by default) re-publishes it
    run.wait(lambda: republished in run.worker.process.all_logs(), 15,
             f"{victim} re-published by the worker's sweep")
    republished_after = time.monotonic() - killed_at
    run.wait(lambda: len(run.starts(victim)) >= 2, 15, f"{victim} to run again")
    resumed_after = time.monotonic() - killed_at
    run.wait(lambda: run.done(longs + shorts), 60, "all works done")
    done_after = time.monotonic() - sent_at
    run.wait(lambda: run.queue() == (0, 0) and run.unacked_anywhere() == 0, 15,
             "nothing ready or unacknowledged in the broker")

    resumed = run.starts(victim)
    assert len(resumed) == 2, resumed
    resumed_at = int(str(resumed[1]["row"]))
    assert resumed_at == saved and resumed_at > 0, (
        f"resumed from row {resumed_at}, last checkpoint {saved}")
    counts = effect_log.counts()
    for i in range(ROWS):
        # The row in flight at the kill (checkpointed next) may be seen twice: its effect is
        # outside the store. Every other row once.
        allowed = (1, 2) if i == resumed_at else (1,)
        assert counts[f"row:{victim}:{i}"] in allowed, (i, counts[f"row:{victim}:{i}"])
    assert counts[f"notify:{victim}"] == 1 and counts[f"charge:{victim}"] == 1, counts
    others = _effect_names(longs[1:], shorts)
    assert {n: counts[n] for n in others if counts[n] != 1} == {}, counts
    assert set(counts) == _effect_names(longs, shorts), sorted(counts)
    assert int(str(resumed[1]["epoch"])) > int(str(resumed[0]["epoch"])), resumed
    row = run.project.store.get_work(victim)
    assert row is not None and row.state == "done", row
    run.alive()
    print(f"killed pool process {pid} running {victim} at checkpoint row {saved}; "
          f"re-published {republished_after:.1f}s after the kill, resumed from row "
          f"{resumed_at} {resumed_after:.1f}s after it; all done {done_after:.1f}s after the "
          f"sends; channel closes {run.closes()}; copies settled {len(run.settled())}")
