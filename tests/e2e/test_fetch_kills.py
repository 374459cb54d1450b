"""Queue position under random SIGKILLs with the defaults a user has: Redis with its default
visibility timeout (an hour), no durable submit, Celery's default prefetch, and RabbitMQ.

Three real workers (``-c 2``) run short tasks of three kinds (resumable, plain with
acks_late, plain with Celery's defaults) while whole workers are SIGKILLed at random:
0-300 ms after a burst is published, or right after a restart into a backlog. Each is
restarted at once under the same node name. What a killed worker held (Redis: its holding;
RabbitMQ: its claims in the store) must run again within 5 s of its restart; at the end
every task has run, no two executions of one task overlapped, and nothing is left in Redis's
``unacked`` hash or in a holding.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pytest
import redis

from celery_resilient.broker import keys
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.services import drop_prefixed_tables

from .conftest import Project

KINDS = ("work", "plain_late", "plain_early")
RERUN_WITHIN = 5.0
#: The 5 s bound is the library's latency with a CPU to spare: beside the parallel run (two
#: cores shared by three more tests' workers) a held task waited 5.2 s behind the backlog.
pytestmark = pytest.mark.alone
_INCARNATION = re.compile(r"incarnation=([0-9a-f]{32})")
_READY = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/MainProcess\] \S+ ready\.",
                    re.M)


@dataclass
class Kill:
    worker: LocalWorker
    at: float
    pids: set[int]
    log_no: int  #: the log of the start that follows the kill
    held: set[str] = field(default_factory=set)


def _incarnation(worker: LocalWorker) -> str:
    found = _INCARNATION.findall(worker.process.logs())
    assert found, f"{worker.worker_name} logged no incarnation"
    return str(found[-1])


_RECEIVED_WORK = re.compile(r"Task fetchkill\.work\[([^\]]+)\] received")
_ENDED = re.compile(r"Task fetchkill\.work\[([^\]]+)\] (?:succeeded|ignored|raised|retry)")


def _ready_at(worker: LocalWorker, log_no: int) -> float:
    text = (worker.process.log_dir / f"{worker.process.name}.{log_no}.log").read_text()
    match = _READY.search(text)
    assert match, f"start {log_no} of {worker.worker_name} never became ready"
    return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Campaign:
    def __init__(self, project: Project, effects: EffectLog, seed: int) -> None:
        self.project = project
        self.effects = effects
        self.rng = random.Random(seed)
        self.sent: dict[str, str] = {}
        self.kills: list[Kill] = []
        self.redis = redis.Redis.from_url(project.broker) if project.broker.startswith(
            "redis") else None
        self.workers = [project.nodes.worker(
            "tests.e2e.fetchkillproj", name=f"k{i}", concurrency=2, queues=(project.queue,),
            env=project.env(), start=False) for i in range(3)]
        for w in self.workers:
            w.process.start(wait=False)
        for w in self.workers:
            w.process.ready()

    def send(self, n: int) -> None:
        for _ in range(n):
            kind = self.rng.choice(KINDS)
            task_id = f"{kind}-{uuid.uuid4().hex[:12]}"
            self.project.client.send_task(f"fetchkill.{kind}",
                                          args=(len(self.sent), self.rng.uniform(0.02, 0.4)),
                                          task_id=task_id, queue=self.project.queue)
            self.sent[task_id] = kind

    def kill(self, worker: LocalWorker) -> None:
        proc = worker.process
        pids = {proc.pid or 0, *proc.children()}
        incarnation = _incarnation(worker)
        at = time.time()  # the signal, not the reaping of the group that follows it
        proc.kill("SIGKILL")
        kill = Kill(worker, at, pids, proc.starts + 1)
        kill.held = self._held(incarnation, worker, proc.starts, at)
        self.kills.append(kill)
        proc.start(wait=False)  # at once, under the same node name

    def _held(self, incarnation: str, worker: LocalWorker, log_no: int,
              at: float) -> set[str]:
        """Task ids the dead worker held and had not finished at the kill (``at``)."""
        if self.redis is not None:
            tags = [t.decode() for t in self.redis.smembers(keys.holding(incarnation))]
            entries = self.redis.hmget("unacked", tags) if tags else []
            ids = {json.loads(e)[0]["headers"]["id"] for e in entries if e}
        else:
            # RabbitMQ requeues them itself, at once, and a copy taken elsewhere moves the
            # claim in milliseconds (the dead worker's session proves it gone): its own log
            # of that start names the resumable tasks it received and had not ended.
            log = (worker.process.log_dir / f"{worker.process.name}.{log_no}.log").read_text()
            ids = set(_RECEIVED_WORK.findall(log)) - set(_ENDED.findall(log))
        # Unfinished at the kill, not when this reads: on RabbitMQ a copy taken by another
        # worker can have run and ended by now, and is still a message the kill made it hold.
        return {i for i in ids
                if not any(e["ts"] < at for e in self.effects.entries(f"end:{i}"))}

    def _finished(self, task_id: str) -> bool:
        if self.sent.get(task_id) == "work":
            return self.project.state(task_id) == "done"
        return self.effects.count(f"end:{task_id}") > 0

    def run(self, kills: int) -> None:
        """``kills`` SIGKILLs: every fifth round kills twice (the second right after the
        restart into a backlog)."""
        k = 0
        while len(self.kills) < kills:
            victim = self.workers[k % len(self.workers)]
            victim.process.ready()
            if k % 5 == 4 and len(self.kills) < kills - 1:  # right after a restart, backlog
                self.kill(victim)
                self.send(24)
                victim.process.ready()
                time.sleep(self.rng.uniform(0, 0.1))
            else:  # 0-300 ms after a burst
                self.send(8)
                time.sleep(self.rng.uniform(0, 0.3))
            self.kill(victim)
            k += 1
        for w in self.workers:
            w.process.ready()

    # -- what must hold ---------------------------------------------------------------------

    def all_ran(self) -> bool:
        starts = {e["effect"][6:] for e in self.effects.entries() if e["effect"].startswith(
            "start:")}
        for task_id, kind in self.sent.items():
            if self._finished(task_id):
                continue
            if kind == "plain_early" and task_id in starts and self._started_by_killed(
                    task_id):
                continue  # acked when it started, then killed: Celery's at-most-once
            return False
        return True

    def _started_by_killed(self, task_id: str) -> bool:
        killed = set().union(*(k.pids for k in self.kills))
        return any(e["pid"] in killed for e in self.effects.entries(f"start:{task_id}"))

    def assert_no_overlap(self) -> None:
        killed_at = {pid: k.at for k in self.kills for pid in k.pids}
        by_task: dict[str, list[dict[str, Any]]] = {}
        for e in self.effects.entries():
            kind, _, task_id = e["effect"].partition(":")
            by_task.setdefault(task_id, []).append({**e, "kind": kind})
        for task_id, events in by_task.items():
            starts = [e for e in events if e["kind"] == "start"]
            for earlier, later in itertools.pairwise(starts):
                ends = [e["ts"] for e in events if e["kind"] == "end"
                        and e["pid"] == earlier["pid"] and e["ts"] >= earlier["ts"]]
                over = min(ends) if ends else killed_at.get(earlier["pid"])
                assert over is not None, f"{task_id}: an execution never ended nor died"
                assert over <= later["ts"], (
                    f"{task_id}: two executions overlapped ({earlier['pid']} until {over}, "
                    f"{later['pid']} from {later['ts']})")

    def assert_held_ran_again(self) -> tuple[list[float], int]:
        """Each held, unfinished task started again within RERUN_WITHIN of the restart of
        the last worker that held it: a task given back to the queue and held again by
        another worker killed before it could start it is that kill's to account for.

        Returns the delays and how many times a task was held again by a later kill."""
        delays = []
        held_again = 0
        for n, kill in enumerate(self.kills):
            ready = _ready_at(kill.worker, kill.log_no)
            for task_id in kill.held:
                again = [e["ts"] for e in self.effects.entries(f"start:{task_id}")
                         if e["ts"] > kill.at]
                if not again and self._finished(task_id):
                    continue  # it had finished its body; the store answered the copy
                assert again, f"{task_id}, held by the killed {kill.worker.worker_name}, " \
                              "never ran again"
                first = min(again)
                if any(task_id in later.held and later.at < first
                       for later in self.kills[n + 1:]):
                    held_again += 1
                    continue
                delays.append(first - ready)
                assert delays[-1] <= RERUN_WITHIN, (
                    f"{task_id} ran again {delays[-1]:.1f}s after the restart of "
                    f"{kill.worker.worker_name} (kill {n + 1} of {len(self.kills)}, at "
                    f"{kill.at:.3f}), by pid {self._starter(task_id, first)}; what the "
                    f"workers logged of it:\n{self._story(task_id)}")
        return delays, held_again

    def _starter(self, task_id: str, ts: float) -> object:
        return next((e["pid"] for e in self.effects.entries(f"start:{task_id}")
                     if e["ts"] == ts), None)

    def _story(self, task_id: str) -> str:
        """Every worker log line naming ``task_id``, in time order (for a failure)."""
        lines = [f"{w.worker_name}: {line}" for w in self.workers
                 for line in w.process.all_logs().splitlines() if task_id in line]
        return "\n".join(sorted(lines, key=lambda line: line.split(": ", 1)[1])[:40])

    def assert_nothing_left_in_redis(self) -> None:
        if self.redis is None:
            return
        for w in self.workers:
            for incarnation in set(_INCARNATION.findall(w.process.all_logs())):
                assert not self.redis.exists(keys.holding(incarnation)), incarnation
        mine = {json.loads(e)[2] for e in self.redis.hvals("unacked")} & {self.project.queue}
        assert not mine, "messages of this queue are left in Redis's unacked hash"
        dead = set().union(*(set(_INCARNATION.findall(w.process.all_logs()))
                             for w in self.workers)) - {_incarnation(w) for w in self.workers}
        holders = {h.decode() for h in self.redis.zrange(keys.HOLDERS, 0, -1)}
        assert not dead & holders, "a dead worker is still registered as a holder"


def _campaign(project: Project, effects: EffectLog, kills: int, seed: int) -> Campaign:
    campaign = Campaign(project, effects, seed)
    campaign.run(kills)
    wait_for(campaign.all_ran, 180, "every task to run")
    campaign.assert_no_overlap()
    delays, held_again = campaign.assert_held_ran_again()
    held = sum(len(k.held) for k in campaign.kills)
    # RabbitMQ's view here is the store's: resumable claims only, a third of the tasks
    enough = kills if campaign.redis is not None else kills // 4
    assert held >= enough, f"only {held} held messages over {kills} kills: the kills missed"
    assert len(campaign.kills) == kills
    wait_for(lambda: _quiet(campaign), 30, "the workers to hold nothing")
    campaign.assert_nothing_left_in_redis()
    print(f"{len(campaign.kills)} kills, {len(campaign.sent)} tasks, {held} held at a kill, "
          f"ran again {min(delays):.2f}-{max(delays):.2f}s after the restart, {held_again} "
          "held again by a later kill before they ran")
    return campaign


def _quiet(campaign: Campaign) -> bool:
    if campaign.redis is None:
        return True
    return not any(campaign.redis.scard(keys.holding(_incarnation(w))) for w in campaign.workers)


def test_random_sigkills_on_redis_with_its_defaults(
        make_project: Callable[..., Project], redis_url: str, effect_log: EffectLog) -> None:
    _campaign(make_project(redis_url), effect_log, kills=50, seed=1)


def test_random_sigkills_on_rabbitmq(make_project: Callable[..., Project], amqp_url: str,
                                     effect_log: EffectLog) -> None:
    _campaign(make_project(amqp_url), effect_log, kills=50, seed=2)


def test_random_sigkills_on_rabbitmq_with_a_mariadb_store(
        make_project: Callable[..., Project], amqp_url: str, mysql_url: str,
        table_prefix: str, effect_log: EffectLog) -> None:
    """The store's side of the campaigns on MariaDB: on RabbitMQ what a killed worker held
    comes back through the store's claims (the dead worker's session proves it gone). On
    Redis it comes back from the worker's holding in the broker, whatever the store."""
    project = make_project(amqp_url, mysql_url)
    try:
        _campaign(project, effect_log, kills=50, seed=4)
    finally:
        project.close()
        drop_prefixed_tables(mysql_url, table_prefix)
