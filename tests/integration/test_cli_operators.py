"""``celery resilient status/work/recover/cancel/retry/forget/prune/schedule`` against real
stores and Redis.

The commands run in-process through click (so a test can watch the signals they send) on
stores seeded through the library's own store API, on SQLite and PostgreSQL; one test runs
the real ``celery -A ... resilient`` entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from kombu import Connection
from prometheus_client import REGISTRY
from sqlalchemy import select, update

from celery_resilient import Resilient, cli, signals
from celery_resilient.cli import parse_duration, resilient
from celery_resilient.core import messages
from celery_resilient.core.identity import Owner
from celery_resilient.errors import WorkStopped
from celery_resilient.store.admin_queries import AdminQueries
from celery_resilient.store.contexts import ContextRows
from celery_resilient.store.operator_queries import OperatorQueries, Selection
from celery_resilient.store.schedule import ScheduleStore
from celery_resilient.store.sql import Store

from .helpers import expire, expire_incarnation, owner, run, started, take


def make_app(store: Store, broker: str, **conf: Any) -> Celery:
    app = Celery(f"cli-{uuid.uuid4().hex[:6]}", broker=broker, set_as_current=False)
    app.conf.update(resilient_store_url=store.url, resilient_table_prefix=store.prefix, **conf)
    Resilient(app)
    return app


def invoke(app: Celery, *args: str) -> Result:
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(resilient, list(args), obj=obj, catch_exceptions=False)


def invoke_json(app: Celery, *args: str) -> Any:
    result = invoke(app, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def stored_message(task_id: str, queue: str) -> str:
    """A broker message as a worker's receipt stores it, routed to ``queue``."""
    body = json.dumps([[1], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                 "chord": None}])
    headers = {"lang": "py", "task": "proj.job", "id": task_id, "root_id": task_id,
               "parent_id": None, "group": None, "retries": 0, "argsrepr": "(1,)",
               "kwargsrepr": "{}"}
    return messages.from_publish(body, "application/json", "utf-8", headers, {}, "", queue)


def age(store: Store, key: str, seconds: float) -> None:
    """Make a finished work look finished ``seconds`` ago."""
    w = store.t.work
    past = store.now() - seconds
    with store.begin() as conn:
        conn.execute(update(w).where(w.c.work_key == key)
                     .values(finished_at=past, updated_at=past))


def age_ledger(store: Store, key: str, seconds: float) -> None:
    lg = store.t.ledger
    past = store.now() - seconds
    with store.begin() as conn:
        conn.execute(update(lg).where(lg.c.key == key).values(applied_at=past))


def finish(store: Store, key: str, result: str = '"ok"') -> None:
    claim = run(store, key, owner())
    store.finish(key, claim.epoch, result)


def make_dead(store: Store, key: str) -> None:
    """A work whose execution died once with resilient_max_attempts=1: parked as dead."""
    run(store, key, owner("gone@host"))
    expire(store, key)
    assert take(store, key, owner("other@host"), max_attempts=1).action == "dead"


@pytest.fixture
def app(store: Store, redis_url: str) -> Iterator[Celery]:
    made = make_app(store, redis_url)
    yield made
    made.close()


# -- status -------------------------------------------------------------------------------

def test_status_counts_claims_owners_leases_dead_slots_and_contexts(
        store: Store, app: Celery) -> None:
    who = owner("worker-a@host")
    store.record_receipt("k-reserved", "proj.job", "t1", None, None, who, 300)
    run(store, "k-stuck", owner("worker-b@host"))
    expire(store, "k-stuck", 120)
    finish(store, "k-done")
    make_dead(store, "k-dead")
    ScheduleStore(store).claim("redbeat:job", "beat-1", [(1000.0, "tid-slot")], [],
                               marker=1000.0)
    ContextRows(store).create("session:1", '{"turns": []}')

    data = invoke_json(app, "status")

    assert data["work"] == {"reserved": 1, "running": 1, "done": 1, "dead": 1}
    assert {(o["state"], o["owner"], o["count"]) for o in data["open_by_owner"]} == {
        ("reserved", "worker-a@host", 1), ("running", "worker-b@host", 1)}
    assert data["oldest_lease"]["work_key"] == "k-stuck"
    assert data["oldest_lease"]["left_s"] < -100
    assert data["expired_leases"] == 1
    assert [d["work_key"] for d in data["dead"]] == ["k-dead"]
    assert "died 1 times" in data["dead"][0]["error"]
    assert data["beat"]["slots_pending"] == 1
    assert data["contexts"]["count"] == 1

    human = invoke(app, "status")
    assert human.exit_code == 0, human.output
    assert "k-stuck EXPIRED" in human.output
    assert "expired leases: 1" in human.output
    assert "beat slots claimed, not sent: 1" in human.output
    assert "worker-a@host" in human.output and "k-dead" in human.output


def test_status_masks_the_store_password(pg_url: str, table_prefix: str,
                                         redis_url: str) -> None:
    url = pg_url.replace("postgres@", "postgres:s3cret-pw@")
    assert "s3cret-pw" in url
    store = Store(url, table_prefix)  # trust authentication: the password is not checked
    store.migrate()
    try:
        app = make_app(store, redis_url)
        for args in (("status",), ("status", "--json")):
            result = invoke(app, *args)
            assert result.exit_code == 0, result.output
            assert "s3cret-pw" not in result.output
            assert "postgres:***@" in result.output
    finally:
        store.dispose()


def test_commands_refuse_a_store_without_schema(tmp_path: Path, redis_url: str) -> None:
    store = Store(f"sqlite:///{tmp_path}/empty.sqlite3", "resilient_")
    app = make_app(store, redis_url, resilient_auto_migrate=False)  # as a worker: no migration
    result = invoke(app, "status")
    assert result.exit_code == 1
    assert "resilient migrate" in result.output
    assert "Traceback" not in result.output


# -- work ---------------------------------------------------------------------------------

def test_work_lists_with_filters_and_limit(store: Store, app: Celery) -> None:
    store.record_receipt("a-1", "proj.alpha", "t-a1", None, None, owner("w1@h"), 300)
    store.record_receipt("a-2", "proj.alpha", "t-a2", None, None, owner("w2@h"), 300)
    store.record_receipt("b-1", "proj.beta", "t-b1", None, None, owner("w1@h"), 300)
    finish(store, "b-2")

    everything = invoke_json(app, "work")
    assert {w["work_key"] for w in everything} == {"a-1", "a-2", "b-1", "b-2"}
    assert {w["work_key"] for w in invoke_json(app, "work", "--task", "proj.alpha")} == {
        "a-1", "a-2"}
    assert {w["work_key"] for w in invoke_json(app, "work", "--owner", "w1@h")} == {
        "a-1", "b-1"}
    assert [w["work_key"] for w in invoke_json(app, "work", "--state", "done")] == ["b-2"]
    both = invoke_json(app, "work", "--state", "done", "--state", "reserved")
    assert len(both) == 4
    assert len(invoke_json(app, "work", "--limit", "2")) == 2

    table = invoke(app, "work", "--task", "proj.beta")
    assert table.exit_code == 0
    assert "b-1" in table.output and "a-1" not in table.output
    bad = invoke(app, "work", "--state", "nonsense")
    assert bad.exit_code == 2


def test_work_show_has_checkpoint_steps_ledger_and_result(store: Store, app: Celery) -> None:
    claim = run(store, "k-show", owner("w1@h"))
    store.save_checkpoint("k-show", claim.epoch, '{"row": 1}')
    store.save_checkpoint("k-show", claim.epoch, '{"row": 2}')
    store.put_step("k-show", claim.epoch, "notify", '"sent"')
    assert store.ledger_put("charge:k-show", "k-show", claim.epoch, '"receipt-1"')
    store.finish("k-show", claim.epoch, '{"rows": 2}')

    data = invoke_json(app, "work", "show", "k-show")
    assert data["state"] == "done"
    assert data["result"] == {"rows": 2}
    assert data["checkpoint"]["state"] == {"row": 2}
    assert data["checkpoint"]["seq"] == 2
    assert [(s["name"], s["result"]) for s in data["steps"]] == [("notify", "sent")]
    assert [x["key"] for x in data["ledger"]] == ["charge:k-show"]

    human = invoke(app, "work", "show", "k-show")
    assert human.exit_code == 0
    assert '{"row": 2}' in human.output and "checkpoint: #2" in human.output
    assert "notify" in human.output and "charge:k-show" in human.output

    run(store, "k-failed", owner())
    failing = store.get_work("k-failed")
    assert failing is not None
    store.fail("k-failed", failing.epoch, "ValueError: bad row 7")
    assert invoke_json(app, "work", "show", "k-failed")["error"] == "ValueError: bad row 7"

    missing = invoke(app, "work", "show", "no-such-key")
    assert missing.exit_code == 1
    assert "no work is stored under 'no-such-key'" in missing.output


# -- recover ------------------------------------------------------------------------------

@pytest.fixture
def broker_queue(redis_url: str, queue_name: str) -> Iterator[Any]:
    with Connection(redis_url) as conn:
        queue = conn.SimpleQueue(queue_name)
        try:
            yield queue
        finally:
            queue.queue.delete()
            queue.close()


def test_recover_dry_run_changes_nothing_then_recover_republishes(
        store: Store, redis_url: str, queue_name: str, broker_queue: Any) -> None:
    app = make_app(store, redis_url, resilient_metrics=True)
    key = f"orphan-{uuid.uuid4().hex[:8]}"
    store.record_receipt(key, "proj.job", key, None, stored_message(key, queue_name),
                         owner("dead-worker@host"), 300)
    run(store, key, owner("dead-worker@host"), task_id=key)
    expire(store, key, 60)
    store.record_receipt("k-live", "proj.job", "t-live", None, stored_message("t-live",
                                                                             queue_name),
                         owner("live-worker@host"), 300)
    before = store.get_work(key)

    dry = invoke_json(app, "recover", "--dry-run")
    assert [(c["work_key"], c["reason"], c["counts_death"], c["has_message"])
            for c in dry["would_republish"]] == [(key, "lease_expired", True, True)]
    assert store.get_work(key) == before  # nothing changed
    with pytest.raises(broker_queue.Empty):
        broker_queue.get(block=False)  # nothing was published
    human = invoke(app, "recover", "--dry-run")
    assert "1 orphan(s) would be re-published" in human.output and key in human.output

    with_node = invoke_json(app, "recover", "--dry-run", "--node", "live-worker@host")
    assert {(c["work_key"], c["reason"]) for c in with_node["would_republish"]} == {
        (key, "lease_expired"), ("k-live", "node_gone")}
    assert store.get_work(key) == before

    sample = ("resilient_work_recovered_total", {"task": "proj.job"})
    counter_before = REGISTRY.get_sample_value(*sample) or 0.0
    seen: list[dict[str, Any]] = []

    def on_recovered(sender: Any = None, **kwargs: Any) -> None:
        seen.append({"sender": sender, **kwargs})

    signals.work_recovered.connect(on_recovered, weak=False)
    try:
        done = invoke_json(app, "recover")
    finally:
        signals.work_recovered.disconnect(on_recovered)

    assert [r["work_key"] for r in done["republished"]] == [key]
    assert done["republished"][0]["previous_state"] == "running"
    assert done["not_republished"] == []
    row = store.get_work(key)
    assert row is not None and before is not None
    assert (row.state, row.republished, row.deaths) == ("requeued", before.republished + 1,
                                                         before.deaths + 1)
    live = store.get_work("k-live")
    assert live is not None and live.state == "reserved"  # a live lease is left alone

    message = broker_queue.get(timeout=10)
    assert message.headers["id"] == key
    assert message.headers["resilient_republished"] == 1
    message.ack()

    assert [(s["sender"], s["work_key"], s["task_id"], s["previous_state"],
             s["previous_owner"], s["app"]) for s in seen] == [
        ("proj.job", key, key, "running", "dead-worker@host", app)]
    assert REGISTRY.get_sample_value(*sample) == counter_before + 1  # resilient_metrics=True

    again = invoke_json(app, "recover")
    assert again["republished"] == []  # the new lease holds it until submit_timeout


def test_recover_reports_an_orphan_without_a_stored_message(store: Store, app: Celery) -> None:
    run(store, "k-nomsg", owner("gone@host"))
    expire(store, "k-nomsg")
    dry = invoke_json(app, "recover", "--dry-run")
    assert dry["would_republish"][0]["has_message"] is False
    assert "MISSING" in invoke(app, "recover", "--dry-run").output
    done = invoke_json(app, "recover")
    assert done["republished"] == []
    assert [c["work_key"] for c in done["not_republished"]] == ["k-nomsg"]


# -- prune --------------------------------------------------------------------------------

def test_parse_duration() -> None:
    assert parse_duration("90s") == 90
    assert parse_duration("15m") == 900
    assert parse_duration("7d") == 7 * 86_400
    assert parse_duration("1d12h") == 36 * 3600
    assert parse_duration("2w") == 14 * 86_400
    # A bare number is refused (it used to mean seconds: "7" meant as days deleted nearly
    # everything), and so is a number without a unit inside a combined duration.
    for bad in ("", "0", "0s", "7x", "d", "-1d", "90", "7", "1d12"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError, match="no unit after 7: write 7s, 7m, 7h, 7d or 7w"):
        parse_duration("7")
    with pytest.raises(ValueError, match="unknown unit 'x'"):
        parse_duration("7x")


def test_prune_dry_run_counts_then_deletes_only_old_finished_work(
        store: Store, app: Celery) -> None:
    day = 86_400.0
    for key in ("old-done", "new-done"):
        claim = run(store, key, owner())
        store.save_checkpoint(key, claim.epoch, '{"row": 3}')
        store.put_step(key, claim.epoch, "s1", "1")
        store.put_step(key, claim.epoch, "s2", "2")
        store.ledger_put(f"ledger:{key}", key, claim.epoch, "null")
        store.finish(key, claim.epoch, "null")
    age(store, "old-done", 10 * day)
    age_ledger(store, "ledger:old-done", 10 * day)
    make_dead(store, "old-dead")
    age(store, "old-dead", 10 * day)
    claim = run(store, "old-failed", owner())
    store.fail("old-failed", claim.epoch, "boom")
    age(store, "old-failed", 10 * day)
    running = run(store, "old-running", owner())
    store.ledger_put("ledger:old-running", "old-running", running.epoch, "null")
    age_ledger(store, "ledger:old-running", 10 * day)  # its work is still open: kept
    age(store, "old-running", 10 * day)

    # Ledger markers are deleted only with --ledger (the default changed from on to off).
    dry = invoke_json(app, "prune", "--older-than", "7d", "--dry-run", "--ledger")
    assert dry["would_delete"] == {"work": 3, "checkpoints": 1, "steps": 2, "ledger": 1,
                                   "revocations": 0, "workers": 0}
    assert store.get_work("old-done") is not None  # nothing deleted
    assert store.load_checkpoint("old-done") is not None
    assert "would delete 3 ended work" in invoke(
        app, "prune", "--older-than", "7d", "--dry-run").output

    no_ledger = invoke_json(app, "prune", "--older-than", "7d", "--dry-run", "--no-ledger")
    assert no_ledger["would_delete"]["ledger"] == 0
    assert invoke_json(app, "prune", "--older-than", "7d", "--dry-run")["would_delete"][
        "ledger"] == 0

    done = invoke_json(app, "prune", "--older-than", "7d", "--ledger", "--yes")
    assert done["deleted"] == {"work": 3, "checkpoints": 1, "steps": 2, "ledger": 1,
                               "revocations": 0, "workers": 0}
    for key in ("old-done", "old-dead", "old-failed"):
        assert store.get_work(key) is None
    assert store.load_checkpoint("old-done") is None
    assert store.get_step("old-done", "s1") is None
    assert store.ledger_get("ledger:old-done") is None
    for key in ("new-done", "old-running"):
        assert store.get_work(key) is not None
    assert store.load_checkpoint("new-done") is not None
    assert store.get_step("new-done", "s2") == "2"
    assert store.ledger_get("ledger:new-done") == "null"
    assert store.ledger_get("ledger:old-running") == "null"

    assert invoke_json(app, "prune", "--older-than", "7d", "--yes")["deleted"]["work"] == 0
    assert invoke(app, "prune").exit_code == 2  # --older-than is required


def test_prune_works_through_more_than_one_batch(store: Store, app: Celery) -> None:
    keys = [f"batch-{i}" for i in range(7)]
    for key in keys:
        finish(store, key)
        age(store, key, 3600)
    counts = AdminQueries(store).prune(60, batch=3)
    assert counts.work == 7
    assert all(store.get_work(k) is None for k in keys)


def test_prune_deletes_ledger_markers_only_with_ledger(store: Store, app: Celery) -> None:
    """Deleting a marker removes the exactly-once guard of its key: never by default."""
    assert store.ledger_put("global:1", None, None, "1")
    age_ledger(store, "global:1", 30 * 86_400)
    finish(store, "old-done")
    age(store, "old-done", 30 * 86_400)
    for flags in ((), ("--no-ledger",)):
        assert invoke_json(app, "prune", "--older-than", "7d", "--yes", *flags)["deleted"][
            "ledger"] == 0
        assert store.ledger_get("global:1") == "1"
    assert store.get_work("old-done") is None  # the work went on the first run
    human = invoke(app, "prune", "--older-than", "7d", "--yes")
    assert "ledger markers kept: --ledger deletes them" in human.output
    deleted = invoke_json(app, "prune", "--older-than", "7d", "--yes", "--ledger")["deleted"]
    assert deleted == {"work": 0, "checkpoints": 0, "steps": 0, "ledger": 1, "revocations": 0,
                       "workers": 0}
    assert store.ledger_get("global:1") is None


# -- schedule -----------------------------------------------------------------------------

def test_schedule_shows_last_next_missed_and_pending_slots(store: Store, app: Celery) -> None:
    from celery.schedules import schedule
    from redbeat.decoder import RedBeatJSONEncoder

    definition = json.dumps({"name": "every-minute", "task": "proj.tick", "args": [],
                             "kwargs": {}, "options": {}, "schedule": schedule(60),
                             "enabled": True}, cls=RedBeatJSONEncoder)
    wrapped = json.dumps({"static": True, "definition": definition}, sort_keys=True)
    slots = ScheduleStore(store)
    marker = float(int(store.now()) - 330)  # 5 slots of 60 s since the marker, none sent
    slots.ensure_markers([("redbeat:every-minute", marker, wrapped),
                          ("redbeat:no-definition", marker, None)])
    slots.claim("redbeat:every-minute", "beat-1", [(marker - 60, "tid-a"), (marker, "tid-b")],
                [(marker - 120, "tid-skip")], marker=marker)
    assert slots.mark_sent("redbeat:every-minute", [marker - 60], "beat-1") == 1

    rows = {r["entry"]: r for r in invoke_json(app, "schedule")}
    row = rows["redbeat:every-minute"]
    assert (row["name"], row["task"]) == ("every-minute", "proj.tick")
    assert row["missed"] == 5
    assert row["pending"] == 1 and row["sent"] == 1 and row["skipped"] == 1
    assert row["last_slot"] == _iso(marker)
    assert row["next_slot"] == _iso(marker + 360)
    assert row["last_sent_slot"] == _iso(marker - 60)
    bare = rows["redbeat:no-definition"]
    assert bare["missed"] is None and bare["note"]

    table = invoke(app, "schedule")
    assert table.exit_code == 0
    assert "every-minute" in table.output and _iso(marker + 360) in table.output


def _iso(ts: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


# -- the real entry point -------------------------------------------------------------------

def test_celery_entry_point_runs_the_operator_commands(
        pg_url: str, table_prefix: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env = {**os.environ, "RESILIENT_STORE_URL": pg_url, "RESILIENT_TABLE_PREFIX": table_prefix,
           "RESILIENT_EFFECT_LOG": str(tmp_path / "effects.jsonl")}
    store = Store(pg_url, table_prefix)
    store.migrate()
    try:
        run(store, "k-entry", owner("gone@host"))
        expire(store, "k-entry")

        def celery(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.e2e.proj",
                                   "resilient", *args], env=env, cwd=request.config.rootpath,
                                  capture_output=True, text=True, timeout=60, check=False,
                                  stdin=subprocess.DEVNULL)  # as from cron: no terminal

        status = celery("status")
        assert status.returncode == 0, status.stderr
        assert "k-entry EXPIRED" in status.stdout
        dry = celery("recover", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert [c["work_key"] for c in json.loads(dry.stdout)["would_republish"]] == ["k-entry"]
        shown = celery("work", "show", "k-entry", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["state"] == "running"
        row = store.get_work("k-entry")
        assert row is not None and row.state == "running"  # read-only commands changed nothing

        unconfirmed = celery("cancel", "--state", "running")
        assert unconfirmed.returncode == 1
        assert "stdin is not a terminal: nothing was changed" in unconfirmed.stderr
        bare = celery("prune", "--older-than", "7")
        assert bare.returncode == 2 and "has no unit" in bare.stderr
        row = store.get_work("k-entry")
        assert row is not None and row.state == "running"
        cancelled = celery("cancel", "--state", "running", "--yes", "--json")
        assert cancelled.returncode == 0, cancelled.stderr
        assert [c["work_key"] for c in json.loads(cancelled.stdout)["changed"]] == ["k-entry"]
        row = store.get_work("k-entry")
        assert row is not None and row.state == "cancelled"
    finally:
        store.dispose()


def test_prune_refuses_a_duration_without_a_unit(store: Store, app: Celery) -> None:
    finish(store, "old-done")
    age(store, "old-done", 30 * 86_400)
    bare = invoke(app, "prune", "--older-than", "7", "--yes")
    assert bare.exit_code == 2
    assert "'7' has no unit after 7: write 7s, 7m, 7h, 7d or 7w" in bare.output
    as_json = invoke(app, "prune", "--older-than", "7", "--yes", "--json")
    assert as_json.exit_code == 2
    assert "no unit" in json.loads(as_json.stdout)["error"]
    missing = invoke(app, "prune", "--json")
    assert missing.exit_code == 2 and "--older-than is required" in missing.stdout
    assert store.get_work("old-done") is not None


def test_prune_asks_for_confirmation_unless_yes(
        store: Store, app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    finish(store, "old-done")
    age(store, "old-done", 30 * 86_400)

    batch = invoke(app, "prune", "--older-than", "7d")  # CliRunner's stdin is no terminal
    assert batch.exit_code == 1
    assert "stdin is not a terminal: nothing was changed. Pass --yes" in batch.output
    assert store.get_work("old-done") is not None

    monkeypatch.setattr(cli, "_interactive", lambda: True)
    refused = invoke_with_input(app, "n\n", "prune", "--older-than", "7d")
    assert refused.exit_code == 1
    assert "delete 1 ended work" in refused.output and "older than 7.0d?" in refused.output
    assert "not confirmed: nothing was changed" in refused.output
    assert store.get_work("old-done") is not None
    no_answer = invoke_with_input(app, "", "prune", "--older-than", "7d")
    assert no_answer.exit_code == 1 and store.get_work("old-done") is not None

    confirmed = invoke_with_input(app, "y\n", "prune", "--older-than", "7d", "--json")
    assert confirmed.exit_code == 0, confirmed.output
    assert json.loads(confirmed.stdout)["deleted"]["work"] == 1  # the prompt is on stderr
    assert store.get_work("old-done") is None


def test_prune_deletes_old_revocation_tombstones_but_not_those_of_open_work(
        store: Store, app: Celery) -> None:
    rv = store.t.revocations
    run(store, "k-open", owner(), task_id="t-open")  # running: its tombstone still matters
    store.record_revocations(["t-old", "t-open", "t-new"])
    past = store.now() - 30 * 86_400
    with store.begin() as conn:
        conn.execute(update(rv).where(rv.c.task_id.in_(["t-old", "t-open"]))
                     .values(created_at=past))

    dry = invoke_json(app, "prune", "--older-than", "7d", "--dry-run")
    assert dry["would_delete"]["revocations"] == 1
    assert invoke_json(app, "prune", "--older-than", "7d", "--yes")["deleted"][
        "revocations"] == 1
    assert tombstones(store) == {"t-open", "t-new"}


# -- cancel, retry, forget ----------------------------------------------------------------

def invoke_with_input(app: Celery, text: str, *args: str) -> Result:
    obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(resilient, list(args), obj=obj, input=text,
                              catch_exceptions=False)


def tombstones(store: Store) -> set[str]:
    rv = store.t.revocations
    with store.engine.connect() as conn:
        found = {str(x) for x in conn.execute(select(rv.c.task_id)).scalars()}
        conn.rollback()
    return found


def state_of(store: Store, key: str) -> str | None:
    row = store.get_work(key)
    return None if row is None else row.state


def received(store: Store, key: str, queue: str, who: Owner | None = None) -> None:
    """A delivery a worker recorded (reserved), with its message routed to ``queue``."""
    store.record_receipt(key, "proj.job", key, None, stored_message(key, queue),
                         who or owner("w@host"), 300)


def ended(store: Store, key: str, state: str, queue: str) -> None:
    """Work in the ended ``state``, made the way the library makes it."""
    received(store, key, queue)
    if state == "revoked":
        store.record_revocations([key])
    elif state == "expired":
        store.end_request(key, "expired", "expired before it ran")
    elif state == "cancelled":
        OperatorQueries(store).cancel(Selection(keys=(key,)))
    else:
        claim = run(store, key, owner(), task_id=key)
        if state == "done":
            store.finish(key, claim.epoch, '"ok"')
        else:
            store.fail(key, claim.epoch, f"{state}: boom", state=state)
    assert state_of(store, key) == state


@pytest.fixture
def broker_app(store: Store, redis_url: str) -> Iterator[Celery]:
    made = make_app(store, redis_url)
    yield made
    made.close()


def drain(queue: Any) -> list[Any]:
    got = []
    while True:
        try:
            message = queue.get(block=False)
        except queue.Empty:
            return got
        got.append(message)
        message.ack()


def test_cancel_of_a_running_claim_stops_its_next_fenced_write(
        store: Store, app: Celery) -> None:
    claim = run(store, "k-run", owner("w1@host"))
    store.save_checkpoint("k-run", claim.epoch, '{"row": 1}')

    data = invoke_json(app, "cancel", "k-run", "--reason", "bad input file")
    assert [(c["work_key"], c["previous_state"], c["owner"]) for c in data["changed"]] == [
        ("k-run", "running", "w1@host")]
    assert data["refused"] == []
    row = store.get_work("k-run")
    assert row is not None
    assert (row.state, row.epoch, row.lease_expires_at) == ("cancelled", claim.epoch, None)
    assert row.error == "cancelled by operator: bad input file"
    detail = AdminQueries(store).work_detail("k-run")
    assert detail is not None and detail.work.finished_at is not None

    with pytest.raises(WorkStopped, match="was cancelled while epoch"):
        store.save_checkpoint("k-run", claim.epoch, '{"row": 2}')
    with pytest.raises(WorkStopped):
        store.put_step("k-run", claim.epoch, "notify", '"sent"')
    with pytest.raises(WorkStopped):
        store.finish("k-run", claim.epoch, '"result"')
    assert store.load_checkpoint("k-run") == ('{"row": 1}', 1)  # the refused save changed nothing
    assert state_of(store, "k-run") == "cancelled"
    # The sweeper never takes it back, and a copy of its message runs nothing.
    assert store.claim_orphans(owner("sweeper@host"), 10, 60) == []
    again = take(store, "k-run", owner("w2@host"))
    assert (again.action, again.reason) == ("stopped", "cancelled")


def test_cancel_refuses_ended_and_unknown_work_and_exits_non_zero(
        store: Store, app: Celery, queue_name: str) -> None:
    received(store, "k-reserved", queue_name)
    finish(store, "k-done")
    result = invoke(app, "cancel", "k-reserved", "k-done", "k-missing", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [c["work_key"] for c in data["changed"]] == ["k-reserved"]
    reasons = {r["work_key"]: (r["state"], r["reason"]) for r in data["refused"]}
    assert reasons["k-done"][0] == "done" and "already ended" in reasons["k-done"][1]
    assert reasons["k-missing"] == (None, "no such work in the store")
    assert state_of(store, "k-reserved") == "cancelled"
    assert state_of(store, "k-done") == "done"
    row = store.get_work("k-reserved")
    assert row is not None and row.error == "cancelled by operator"

    human = invoke(app, "cancel", "k-done")
    assert human.exit_code == 1
    assert "cancelled 0 unit(s) of work" in human.output and "refused 1:" in human.output


def test_cancel_filter_by_state_task_and_age(store: Store, app: Celery,
                                             queue_name: str) -> None:
    received(store, "a-old", queue_name)
    received(store, "a-new", queue_name)
    run(store, "b-run", owner())
    finish(store, "a-done")
    age(store, "a-old", 3 * 3600)
    age(store, "a-done", 3 * 3600)

    dry = invoke_json(app, "cancel", "--older-than", "1h", "--dry-run")
    assert [c["work_key"] for c in dry["would_change"]] == ["a-old"]  # done is not open
    assert {c["work_key"] for c in invoke_json(
        app, "cancel", "--state", "reserved", "--dry-run")["would_change"]} == {"a-old",
                                                                                 "a-new"}
    assert [c["work_key"] for c in invoke_json(
        app, "cancel", "--task", "proj.task", "--dry-run")["would_change"]] == ["b-run"]
    # A named key must match the filter too.
    both = invoke(app, "cancel", "a-new", "--older-than", "1h", "--dry-run", "--json")
    assert both.exit_code == 1
    assert "does not match the filter" in json.loads(both.stdout)["refused"][0]["reason"]
    assert {k: state_of(store, k) for k in ("a-old", "a-new", "b-run")} == {
        "a-old": "reserved", "a-new": "reserved", "b-run": "running"}  # dry runs

    done = invoke_json(app, "cancel", "--state", "reserved", "--older-than", "1h", "--yes")
    assert [c["work_key"] for c in done["changed"]] == ["a-old"]
    assert state_of(store, "a-old") == "cancelled" and state_of(store, "a-new") == "reserved"


def test_selection_errors_are_usage_errors_and_json_with_json(
        store: Store, app: Celery) -> None:
    for args, why in ((("cancel",), "name work keys or give a filter"),
                      (("cancel", "--state", "done"), "cancel applies to work in"),
                      (("retry", "--state", "done"), "retry applies to work in"),
                      (("forget", "--state", "running"), "forget applies to work in"),
                      (("forget", "--state", "nonsense"), "unknown state"),
                      (("retry", "--older-than", "3"), "no unit")):
        human = invoke(app, *args)
        assert human.exit_code == 2, (args, human.output)
        assert why in human.output, (args, human.output)
        machine = invoke(app, *args, "--json")
        assert machine.exit_code == 2
        assert why in json.loads(machine.stdout)["error"], args


def test_a_filter_asks_for_confirmation_and_a_no_changes_nothing(
        store: Store, app: Celery, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    received(store, "k-1", queue_name)
    received(store, "k-2", queue_name)

    batch = invoke(app, "cancel", "--state", "reserved")
    assert batch.exit_code == 1
    assert "cancel with a filter asks for confirmation, and stdin is not a terminal" in \
        batch.output
    assert "Pass --yes" in batch.output
    machine = invoke(app, "cancel", "--state", "reserved", "--json")
    assert machine.exit_code == 1 and "--yes" in json.loads(machine.stdout)["error"]
    assert {state_of(store, k) for k in ("k-1", "k-2")} == {"reserved"}

    monkeypatch.setattr(cli, "_interactive", lambda: True)
    refused = invoke_with_input(app, "n\n", "cancel", "--state", "reserved")
    assert refused.exit_code == 1
    assert "would cancel 2 unit(s) of work" in refused.output  # what the question is about
    assert "cancel 2 unit(s) of work (state reserved)? [y/N]" in refused.output
    assert "not confirmed: nothing was changed" in refused.output
    assert {state_of(store, k) for k in ("k-1", "k-2")} == {"reserved"}

    received(store, "k-3", queue_name)
    confirmed = invoke_with_input(app, "y\n", "forget", "--state", "cancelled", "--json")
    assert confirmed.exit_code == 0 and json.loads(confirmed.stdout)["changed"] == []

    # Named keys need no confirmation; what is confirmed is what was listed.
    assert invoke(app, "cancel", "k-1").exit_code == 0
    confirmed = invoke_with_input(app, "y\n", "cancel", "--state", "reserved", "--json")
    assert confirmed.exit_code == 0, confirmed.output
    assert sorted(c["work_key"] for c in json.loads(confirmed.stdout)["changed"]) == [
        "k-2", "k-3"]


@pytest.mark.parametrize("state", ["failed", "ignored", "revoked", "expired", "cancelled",
                                   "dead"])
def test_retry_requeues_ended_work_and_sends_its_message_again(
        store: Store, broker_app: Celery, queue_name: str, broker_queue: Any,
        state: str) -> None:
    key = f"k-{state}"
    if state == "dead":
        received(store, key, queue_name, owner("gone@host"))
        run(store, key, owner("gone@host"), task_id=key)
        expire(store, key)
        assert take(store, key, owner("other@host"), task_id=key,
                    max_attempts=1).action == "dead"
    else:
        ended(store, key, state, queue_name)
    before = store.get_work(key)
    assert before is not None

    data = invoke_json(broker_app, "retry", key)
    assert [(c["work_key"], c["previous_state"]) for c in data["changed"]] == [(key, state)]
    assert data["refused"] == [] and data["not_sent"] == []
    row = store.get_work(key)
    assert row is not None
    assert (row.state, row.deaths, row.republished, row.error) == ("requeued", 0, 0, None)
    assert (row.attempts, row.epoch) == (before.attempts, before.epoch)
    assert row.owner_node is None
    assert row.lease_expires_at is not None and row.lease_expires_at > store.now()
    detail = AdminQueries(store).work_detail(key)
    assert detail is not None and detail.work.finished_at is None
    sent = drain(broker_queue)
    assert [(m.headers["id"], m.headers["resilient_republished"]) for m in sent] == [(key, 1)]
    assert tombstones(store) == set()

    again = take(store, key, owner("w2@host"), task_id=key)
    assert again.action == "run" and again.claim is not None
    assert again.claim.epoch == before.epoch + 1


def test_retry_of_revoked_work_removes_its_tombstone_so_a_later_take_runs_it(
        store: Store, broker_app: Celery, queue_name: str, broker_queue: Any) -> None:
    received(store, "k-rev", queue_name)
    assert store.record_revocations(["k-rev"]) == 1
    assert tombstones(store) == {"k-rev"}
    stopped = take(store, "k-rev", owner(), task_id="k-rev")
    assert (stopped.action, stopped.reason) == ("stopped", "revoked")

    dry = invoke_json(broker_app, "retry", "k-rev", "--dry-run")
    assert [c["work_key"] for c in dry["would_change"]] == ["k-rev"]
    assert tombstones(store) == {"k-rev"} and state_of(store, "k-rev") == "revoked"
    assert drain(broker_queue) == []

    assert invoke_json(broker_app, "retry", "k-rev")["changed"][0]["previous_state"] == \
        "revoked"
    assert tombstones(store) == set()
    assert [m.headers["id"] for m in drain(broker_queue)] == ["k-rev"]
    outcome = take(store, "k-rev", owner(), task_id="k-rev")
    assert outcome.action == "run"


def test_retry_refuses_done_open_and_messageless_work(
        store: Store, broker_app: Celery, queue_name: str, broker_queue: Any) -> None:
    ended(store, "k-done", "done", queue_name)
    received(store, "k-open", queue_name)
    nomsg = run(store, "k-nomsg", owner())  # taken without a receipt: no stored message
    store.fail("k-nomsg", nomsg.epoch, "boom")
    before = {k: store.get_work(k) for k in ("k-done", "k-open", "k-nomsg")}

    result = invoke(broker_app, "retry", "k-done", "k-open", "k-nomsg", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["changed"] == []
    reasons = {r["work_key"]: r["reason"] for r in data["refused"]}
    assert "it is done" in reasons["k-done"]
    assert "still open (reserved)" in reasons["k-open"]
    assert "no broker message is stored" in reasons["k-nomsg"]
    assert {k: store.get_work(k) for k in before} == before
    assert drain(broker_queue) == []

    by_filter = invoke(broker_app, "retry", "--state", "failed", "--yes", "--json")
    assert by_filter.exit_code == 1  # the filter found it, and it was refused
    assert [r["work_key"] for r in json.loads(by_filter.stdout)["refused"]] == ["k-nomsg"]


def test_retry_drops_the_expiry_of_the_message_it_sends(
        store: Store, broker_app: Celery, queue_name: str, broker_queue: Any) -> None:
    message = json.loads(stored_message("k-exp", queue_name))
    message["headers"]["expires"] = "2001-01-01T00:00:00+00:00"
    store.record_receipt("k-exp", "proj.job", "k-exp", None, json.dumps(message),
                         owner(), 300)
    store.end_request("k-exp", "expired", "expired before it ran")

    assert invoke_json(broker_app, "retry", "k-exp")["changed"][0]["work_key"] == "k-exp"
    [sent] = drain(broker_queue)
    assert sent.headers["id"] == "k-exp" and sent.headers["expires"] is None
    stored = store.get_message("k-exp")  # what the sweeper would send again is the same
    assert stored is not None and json.loads(stored)["headers"]["expires"] is None


def test_forget_deletes_ended_work_with_checkpoint_and_steps_but_keeps_ledger(
        store: Store, app: Celery, queue_name: str) -> None:
    claim = run(store, "k-failed", owner())
    store.save_checkpoint("k-failed", claim.epoch, '{"row": 4}')
    store.put_step("k-failed", claim.epoch, "s1", "1")
    assert store.ledger_put("charge:k-failed", "k-failed", claim.epoch, '"r-1"')
    store.fail("k-failed", claim.epoch, "boom")
    received(store, "k-open", queue_name)

    dry = invoke_json(app, "forget", "k-failed", "--dry-run")
    assert (dry["checkpoints"], dry["steps"]) == (1, 1)
    assert [c["work_key"] for c in dry["would_change"]] == ["k-failed"]
    assert store.get_work("k-failed") is not None and store.load_checkpoint("k-failed")

    result = invoke(app, "forget", "k-failed", "k-open", "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [c["work_key"] for c in data["changed"]] == ["k-failed"]
    assert (data["checkpoints"], data["steps"]) == (1, 1)
    assert [(r["work_key"], r["state"]) for r in data["refused"]] == [("k-open", "reserved")]
    assert "still open" in data["refused"][0]["reason"]
    assert store.get_work("k-failed") is None
    assert store.load_checkpoint("k-failed") is None
    assert store.get_step("k-failed", "s1") is None
    assert store.ledger_get("charge:k-failed") == '"r-1"'  # exactly-once still holds
    assert state_of(store, "k-open") == "reserved"

    human = invoke(app, "forget", "--state", "failed", "--yes")
    assert "forgot 0 unit(s) of work with 0 checkpoints and 0 steps (ledger markers kept)" \
        in human.output


def test_dry_runs_change_nothing(store: Store, broker_app: Celery, queue_name: str,
                                 broker_queue: Any) -> None:
    received(store, "k-open", queue_name)
    ended(store, "k-failed", "failed", queue_name)
    ended(store, "k-rev", "revoked", queue_name)
    rows = {k: store.get_work(k) for k in ("k-open", "k-failed", "k-rev")}
    for args in (("cancel", "--state", "reserved"), ("retry", "--state", "failed"),
                 ("retry", "k-rev"), ("forget", "--state", "failed"),
                 ("forget", "k-failed", "k-rev")):
        result = invoke(broker_app, *args, "--dry-run")
        assert result.exit_code == 0, (args, result.output)
        assert "would " in result.output
    assert {k: store.get_work(k) for k in rows} == rows
    assert tombstones(store) == {"k-rev"}
    assert drain(broker_queue) == []


def test_filters_work_through_batches_past_refused_rows(store: Store, queue_name: str) -> None:
    for i in range(5):
        ended(store, f"k-{i}", "failed", queue_name)
    for i in range(3):  # failed without a stored message: refused, yet still matching
        claim = run(store, f"k-nomsg-{i}", owner())
        store.fail(f"k-nomsg-{i}", claim.epoch, "boom")
    batches: list[list[str]] = []
    report = OperatorQueries(store, batch=2).retry(
        Selection(states=("failed",)), 60, on_batch=lambda b: batches.append(
            [t.work_key for t in b]))
    assert sorted(t.work_key for t in report.changed) == [f"k-{i}" for i in range(5)]
    assert sorted(r.work_key for r in report.refused) == [f"k-nomsg-{i}" for i in range(3)]
    assert sum(len(b) for b in batches) == 5 and max(len(b) for b in batches) <= 2
    forgotten = OperatorQueries(store, batch=3).forget(Selection(states=("failed",)))
    assert sorted(t.work_key for t in forgotten.changed) == [f"k-nomsg-{i}" for i in range(3)]
    assert store.count_by_state() == {"requeued": 5}


def test_retry_with_the_broker_down_leaves_the_work_requeued_for_the_sweep(
        store: Store, queue_name: str) -> None:
    ended(store, "k-failed", "failed", queue_name)
    down = make_app(store, "redis://127.0.0.1:1/0")
    try:
        result = invoke(down, "retry", "k-failed", "--json")
    finally:
        down.close()
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [c["work_key"] for c in data["changed"]] == ["k-failed"]
    assert [n["work_key"] for n in data["not_sent"]] == ["k-failed"]
    row = store.get_work("k-failed")
    assert row is not None and row.state == "requeued"
    assert row.lease_expires_at is not None  # the sweeper re-sends it when this runs out


def test_cancel_shows_revoked_to_the_caller_at_once(store: Store, redis_url: str) -> None:
    """A cancelled request writes no result of its own, and its owner may be gone: the caller
    sees REVOKED as soon as the operator cancels."""
    app = make_app(store, redis_url, result_backend=redis_url)
    try:
        run(store, "k-caller", owner("gone@host"), task_id="t-caller")
        store.record_receipt("k-queued", "proj.job", "t-queued", None, '{"m": 1}',
                             owner("w@host"), 300)
        assert app.AsyncResult("t-caller").state == "PENDING"
        data = invoke_json(app, "cancel", "k-caller", "k-queued", "--reason", "operator test")
        assert len(data["changed"]) == 2
        for task_id in ("t-caller", "t-queued"):
            result = app.AsyncResult(task_id)
            assert result.state == "REVOKED"
            assert "operator test" in str(result.result)
            result.forget()
    finally:
        app.close()


# -- workers pruned, JSON errors, the embedded SQLite default, migrate --json ----------

def test_prune_deletes_old_stopped_worker_starts_never_a_live_one(
        store: Store, app: Celery) -> None:
    from .helpers import died, expire_incarnation, started

    day = 86_400.0
    wk = store.t.workers
    stopped_old = owner("old@host")
    died(store, stopped_old)
    killed_old = started(store, owner("killed@host"))  # SIGKILLed, never declared dead
    expire_incarnation(store, killed_old, 10 * day)
    holder = started(store, owner("holder@host"))  # gone long ago but still owns open work
    run(store, "k-held", holder)
    expire_incarnation(store, holder, 10 * day)
    live = started(store, owner("live@host"))
    stopped_new = owner("recent@host")
    died(store, stopped_new)
    with store.begin() as conn:
        conn.execute(update(wk).where(wk.c.incarnation == stopped_old.incarnation)
                     .values(stopped_at=store.now() - 10 * day))

    dry = invoke_json(app, "prune", "--older-than", "7d", "--dry-run")
    assert dry["would_delete"]["workers"] == 2
    done = invoke_json(app, "prune", "--older-than", "7d", "--yes")
    assert done["deleted"]["workers"] == 2
    with store.engine.connect() as conn:
        left = set(conn.execute(select(wk.c.incarnation)).scalars())
    assert left == {holder.incarnation, live.incarnation, stopped_new.incarnation}
    # A cutoff of one second never reaches a worker whose lease is live.
    with store.begin() as conn:
        conn.execute(update(wk).where(wk.c.incarnation == stopped_new.incarnation)
                     .values(stopped_at=store.now() - 5))
    assert invoke_json(app, "prune", "--older-than", "1s", "--yes")["deleted"]["workers"] == 1
    with store.engine.connect() as conn:
        assert live.incarnation in set(conn.execute(select(wk.c.incarnation)).scalars())
    human = invoke(app, "prune", "--older-than", "7d", "--yes")
    assert "0 stopped worker starts" in human.output and "store: " in human.output


def test_json_errors_are_json_with_the_exit_code(tmp_path: Path, redis_url: str) -> None:
    store = Store(f"sqlite:///{tmp_path}/empty.sqlite3", "resilient_")
    app = make_app(store, redis_url, resilient_auto_migrate=False)
    for args in (("status",), ("work",), ("work", "show", "k"), ("recover", "--dry-run"),
                 ("schedule",), ("cancel", "k")):
        result = invoke(app, *args, "--json")
        assert result.exit_code == 1, (args, result.output)
        data = json.loads(result.stdout)
        assert "missing" in data["error"] and "resilient migrate" in data["error"], args
        assert "Traceback" not in result.output
    human = invoke(app, "status")
    assert human.exit_code == 1 and "Error: the schema of the store sqlite:///" in human.output


def test_status_on_the_embedded_sqlite_default_migrates_as_the_worker_would(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any worker started, the default store is not 'missing': the worker would
    create it itself, and so does the CLI (resilient_auto_migrate unset)."""
    monkeypatch.chdir(tmp_path)
    app = Celery(f"cli-{uuid.uuid4().hex[:6]}", broker=redis_url, set_as_current=False)
    Resilient(app)
    try:
        result = invoke(app, "status", "--json")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["store"] == f"sqlite:///{tmp_path}/celery-resilient.sqlite3"
        assert data["schema"]["current"] == data["schema"]["head"]
        assert data["work"] == {} and data["workers"] == [] and data["open"] == []
    finally:
        app.close()


def test_migrate_takes_json(tmp_path: Path, redis_url: str) -> None:
    store = Store(f"sqlite:///{tmp_path}/m.sqlite3", "resilient_")
    app = make_app(store, redis_url, resilient_auto_migrate=False)
    first = invoke_json(app, "migrate")
    assert first["changed"] and first["before"] is None
    assert first["revision"] == first["head"] and first["store"].endswith("/m.sqlite3")
    again = invoke_json(app, "migrate")
    assert not again["changed"] and again["before"] == again["revision"]
    human = invoke(app, "migrate")
    assert "(already current)" in human.output
    store.dispose()


def test_a_live_workers_claims_are_not_reported_as_orphans(store: Store) -> None:
    """Workers renew their incarnation's lease, not each claim's: a claim whose own lease
    field has long passed is live while its incarnation's lease is, and ``status`` and
    ``recover --dry-run`` must say so (the sweep judges the same way)."""
    live = started(store, owner("live@host"))
    run(store, "k-live", live)
    expire(store, "k-live", seconds_ago=120)  # the claim row's own field, never renewed
    admin = AdminQueries(store)
    assert admin.orphan_candidates(100) == []
    assert admin.status().expired_leases == 0

    expire_incarnation(store, live)  # its worker stopped renewing: now it is an orphan
    assert [c.work_key for c in admin.orphan_candidates(100)] == ["k-live"]
    assert admin.status().expired_leases == 1
