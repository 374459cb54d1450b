"""Any serializer is re-publishable: pickle and YAML work survives SIGKILL like JSON work.

Workers run ``tests/e2e/serialproj.py`` with ``task_serializer`` pickle or yaml (msgpack is
not installed here; kombu would refuse it at send). Its ``crunch`` task gets arguments JSON
cannot carry (a set, a tuple, bytes, a datetime, a class instance), checkpoints every row and
applies one ledger effect, and returns a Decimal and what it saw of its arguments: the resumed
run must see the very same types, and the caller must get the result.

The take-before-receipt case is forced with ``RESILIENT_DROP_RECEIPTS`` (every receipt flush
of the worker fails): the only stored message is the call form the pool's take built, and on
Redis (visibility timeout: 1 h) only the sweeper's re-publish of it can bring the work back.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from kombu.serialization import registry

from celery_resilient.core import codec, messages
from celery_resilient.core.identity import Owner
from celery_resilient.testing import EffectLog, WaitTimeout, wait_for
from celery_resilient.testing.nodes import LocalWorker

from . import serialproj
from .conftest import Project, close_result_client

APP = serialproj.NAME
FAST = {"resilient_submit_timeout": 2, "resilient_sweep_interval": 0.5,
        "resilient_heartbeat_interval": 0.5, "resilient_lease_seconds": 3}
ROWS = 16
DELAY = 0.15
SETTLE = 60.0


class Lab:
    """``serialproj`` workers with one serializer, a client app of the same configuration."""

    def __init__(self, project: Project, effects: EffectLog, serializer: str,
                 **env: str) -> None:
        project.extra = {**FAST, **project.extra}
        self.project = project
        self.store = project.store
        self.effects = effects
        self.serializer = serializer
        # C_FORCE_ROOT: Celery refuses to run a pickle-accepting worker as root (CI runs as
        # root in a container).
        self.env = {**project.env(), "RESILIENT_SERIALIZER": serializer, "C_FORCE_ROOT": "1",
                    **env}
        self.client: Celery = serialproj.create_app(self.env)

    def worker(self, name: str = "serial") -> LocalWorker:
        return self.project.nodes.worker(APP, name=name, queues=(self.project.queue,),
                                         env=self.env)

    def send_crunch(self, rows: int = ROWS) -> tuple[str, Any]:
        task_id = f"crunch-{self.serializer}-{uuid.uuid4().hex[:8]}"  # the backend is shared
        result = self.client.send_task(f"{APP}.crunch",
                                       args=(serialproj.payload(self.serializer), rows, DELAY),
                                       task_id=task_id, queue=self.project.queue)
        return task_id, result

    def checkpointed(self, key: str) -> int:
        found = self.store.load_checkpoint(key)
        return 0 if found is None else int(codec.decode(found[0])["row"])

    def state(self, key: str) -> str | None:
        row = self.store.get_work(key)
        return None if row is None else row.state

    def kill_mid_task(self, worker: LocalWorker, key: str) -> int:
        """SIGKILL the whole worker after 4 checkpointed rows; the rows durably saved."""
        wait_for(lambda: self.checkpointed(key) >= 4, 30, "4 checkpointed rows")
        worker.kill("SIGKILL")
        assert self.state(key) == "running"
        return self.checkpointed(key)

    def assert_resumed_exactly_once(self, key: str, saved: int) -> None:
        """Two starts (the second at the saved row, seeing the same arguments); every row
        but the one in flight at the kill once, the ledger effect once."""
        starts = self.effects.entries(f"start:{key}")
        assert [s["row"] for s in starts] == [0, saved], starts
        assert starts[1]["seen"] == starts[0]["seen"] == expected_seen(self.serializer)
        counts = self.effects.counts()
        for i in range(ROWS):
            allowed = (1, 2) if i == saved else (1,)
            assert counts[f"row:{key}:{i}"] in allowed, f"row {i} ran {counts[f'row:{key}:{i}']}x"
        assert counts[f"charge:{key}"] == 1, "ledger effect not applied exactly once"

    def assert_result(self, key: str, result: Any, saved: int) -> None:
        value = result.get(timeout=30)
        assert value == {"rows": ROWS, "resumed_from": saved,
                         "seen": expected_seen(self.serializer),
                         "charge": f"receipt-{key}", "total": Decimal(ROWS) / 4}
        assert isinstance(value["total"], Decimal)

    def close(self) -> None:
        close_result_client(self.client)


def expected_seen(serializer: str) -> Any:
    """What the body sees of ``payload(serializer)`` when every type survived."""
    return json.loads(json.dumps(serialproj.describe(serialproj.payload(serializer))))


@pytest.fixture
def labs() -> Iterator[list[Lab]]:
    made: list[Lab] = []
    yield made
    for lab in made:
        lab.close()


def _lab(labs: list[Lab], project: Project, effects: EffectLog, serializer: str,
         **env: str) -> Lab:
    lab = Lab(project, effects, serializer, **env)
    labs.append(lab)
    return lab


@pytest.mark.parametrize("serializer", ["pickle", "yaml"])
def test_sigkill_mid_task_resumes_with_the_same_arguments(project: Project,
                                                          effect_log: EffectLog,
                                                          labs: list[Lab],
                                                          serializer: str) -> None:
    """The receipt keeps the delivered bytes: re-published as they were, on both brokers."""
    lab = _lab(labs, project, effect_log, serializer)
    worker = lab.worker()
    key, result = lab.send_crunch()
    saved = lab.kill_mid_task(worker, key)
    stored = json.loads(lab.store.get_message(key) or "{}")
    assert stored["content_type"] == registry.name_to_type[serializer]  # the delivered bytes

    worker.restart()
    wait_for(lambda: lab.state(key) == "done", SETTLE, "the work to finish after the restart")
    lab.assert_resumed_exactly_once(key, saved)
    lab.assert_result(key, result, saved)


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
@pytest.mark.parametrize("serializer", ["pickle", "yaml"])
def test_take_before_receipt_is_republished_after_a_kill(project: Project,
                                                         effect_log: EffectLog,
                                                         labs: list[Lab],
                                                         serializer: str) -> None:
    """No receipt ever lands: the pool process's take keeps the call form, the arguments
    with the task's serializer, and the sweeper re-publishes it with that serializer. On
    kombu's own fetch, where only the store can bring the message back (Redis would give it
    back only after its one-hour visibility timeout; the reliable fetch's holding would give
    it back first), and without the batched takes (their take records the delivered
    message itself, as a receipt would: the other tests of this module)."""
    project.extra = {"resilient_reliable_fetch": False, "resilient_batched_takes": False}
    lab = _lab(labs, project, effect_log, serializer, RESILIENT_DROP_RECEIPTS="1")
    worker = lab.worker()
    key, result = lab.send_crunch()
    saved = lab.kill_mid_task(worker, key)
    assert "dropped 1 receipt(s) that cannot be written" in worker.process.logs()
    stored = json.loads(lab.store.get_message(key) or "null")
    assert stored is not None, "the take kept no message"
    assert stored["serialized"]["content_type"] == registry.name_to_type[serializer]
    assert stored["signature"]["task"] == f"{APP}.crunch"
    assert stored["signature"]["options"]["task_id"] == key  # the options stay readable

    worker.restart()
    wait_for(lambda: lab.state(key) == "done", SETTLE, "the work to finish after the restart")
    assert f"re-published orphaned work {key}" in worker.process.logs()
    lab.assert_resumed_exactly_once(key, saved)
    lab.assert_result(key, result, saved)
    assert "unrecoverable" not in worker.process.logs()


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
def test_durable_submit_keeps_pickle_arguments(project: Project, effect_log: EffectLog,
                                               labs: list[Lab], redis_url: str) -> None:
    """A durable submit of pickle arguments is kept (it used to raise); when the broker
    loses the message, the sweeper sends the stored call form and the work runs once."""
    import redis

    project.extra = {"resilient_durable_submit": True}
    lab = _lab(labs, project, effect_log, "pickle")
    crunch = lab.client.tasks[f"{APP}.crunch"]
    key = f"durable-{uuid.uuid4().hex[:8]}"
    result = crunch.apply_async((serialproj.payload("pickle"), 3, 0.01), task_id=key,
                                queue=project.queue)
    stored = json.loads(lab.store.get_message(key) or "null")
    assert stored["serialized"]["content_type"] == registry.name_to_type["pickle"]
    assert redis.Redis.from_url(redis_url).delete(project.queue) == 1  # the broker lost it

    worker = lab.worker()
    wait_for(lambda: lab.state(key) == "done", SETTLE, "the stored call form to run")
    assert f"re-published orphaned work {key}" in worker.process.logs()
    assert result.get(timeout=30)["seen"] == expected_seen("pickle")
    assert effect_log.count(f"start:{key}") == 1
    assert effect_log.count(f"charge:{key}") == 1


def _meta_if_failed(lab: Lab, task_id: str) -> dict[str, Any] | None:
    meta: dict[str, Any] = lab.client.backend.get_task_meta(task_id, cache=False)
    return meta if meta["status"] == "FAILURE" else None


@pytest.mark.parametrize("broker_url", ["redis"], indirect=True)
@pytest.mark.parametrize("stored", ["none", "pickle_in_a_json_app"])
def test_unrecoverable_orphan_ends_dead_once(project: Project, effect_log: EffectLog,
                                             labs: list[Lab], stored: str) -> None:
    """An orphan without a usable message (none kept, or arguments this app refuses to
    decode) is not swept for ever: one warning, then ``dead`` with the reason, and the caller
    sees WorkDead. Nothing more is logged about it afterwards."""
    lab = _lab(labs, project, effect_log, "json")
    key = f"orphan-{stored}-{uuid.uuid4().hex[:8]}"
    message = None
    if stored == "pickle_in_a_json_app":
        pickler = serialproj.create_app({**lab.env, "RESILIENT_SERIALIZER": "pickle"})
        sig = pickler.tasks[f"{APP}.crunch"].signature(
            (serialproj.payload("pickle"), ROWS, DELAY), task_id=key)
        message = messages.from_signature(sig)
        pickler.close()
        assert message is not None and "serialized" in json.loads(message)
    # A take by a worker that is gone (no lease row; its claim's lease ran out at once).
    gone = Owner("gone@nowhere", "gone-incarnation", 1)
    lab.store.take(key, f"{APP}.crunch", key, None, gone, 0.05, 5,
                   is_live=lambda *_: False, message_if_new=lambda: message)
    assert lab.store.get_message(key) == message

    worker = lab.worker()
    wait_for(lambda: lab.state(key) == "dead", SETTLE, "the orphan to end dead")
    row = lab.store.get_work(key)
    assert row is not None and row.error is not None
    assert "cannot be re-published" in row.error
    if stored == "none":
        assert "no message is stored" in row.error
    else:
        assert "application/x-python-serialize" in row.error and "accept_content" in row.error
    # The store ends it first, the result backend is told next (worker/recovery.py): wait for
    # that write instead of racing it (a busy machine read PENDING in between).
    meta = wait_for(lambda: _meta_if_failed(lab, key), 10, "the caller to be told FAILURE")
    assert "WorkDead" in repr(meta["result"])

    logs_at_end = worker.process.logs()
    assert logs_at_end.count(f"orphan {key} cannot be re-published") == 1
    with pytest.raises(WaitTimeout):  # a window of many sweeps: nothing more about it
        wait_for(lambda: worker.process.logs().count(key) > logs_at_end.count(key), 5,
                 "another log line about the dead orphan")
    assert lab.state(key) == "dead"
    assert effect_log.count(f"start:{key}") == 0
