"""``Resilient(celery).init_app(flask_app)`` with a real Flask app and real stores."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from flask import Flask, current_app

from celery_resilient import ConfigurationError, Resilient, ResumableTask
from celery_resilient.contrib.flask import EXTENSION_NAME
from celery_resilient.core import codec
from celery_resilient.store.sql import Store
from celery_resilient.testing import EffectLog, wait_for
from celery_resilient.testing.nodes import LocalWorker
from celery_resilient.testing.plugin import NodeFactory


def _celery() -> Celery:
    return Celery(f"flask-test-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)


def test_init_app_reads_flask_config_and_runs_a_task_on_that_store(
        store_url: str, table_prefix: str) -> None:
    flask_app = Flask(__name__)
    flask_app.config.update(RESILIENT_STORE_URL=store_url, RESILIENT_TABLE_PREFIX=table_prefix,
                            RESILIENT_LEASE_SECONDS=12, RESILIENT_AUTO_MIGRATE=True,
                            SECRET_KEY="not-copied")
    celery = _celery()
    rt = Resilient(celery)
    rt.init_app(flask_app)

    assert flask_app.extensions[EXTENSION_NAME] is rt
    assert rt.config.store_url == store_url
    assert rt.config.table_prefix == table_prefix
    assert rt.config.lease_seconds == 12.0
    assert celery.conf.get("secret_key") is None  # only RESILIENT_* keys are copied

    @celery.task(base=ResumableTask, bind=True, shared=False, name="flask_test.double")
    def double(self: ResumableTask, n: int) -> int:
        self.checkpoint.save({"n": n})
        return n * 2

    try:
        result = double.apply(args=(21,), task_id="flask-double-1")
        assert result.get() == 42
        # Read back through a store of our own: the row is where the Flask config said.
        check = Store(store_url, table_prefix)
        row = check.get_work("flask-double-1")
        assert row is not None and row.state == "done"
        assert codec.decode(row.result_json) == 42
        check.dispose()
    finally:
        rt.store.dispose()


@pytest.mark.parametrize(("key", "value", "named"), [
    ("RESILIENT_LEASE_SECOND", 10, "'RESILIENT_LEASE_SECOND'"),  # misspelt: unknown
    ("RESILIENT_LEASE_SECONDS", "soon", "RESILIENT_LEASE_SECONDS="),  # not a number
    ("RESILIENT_TABLE_PREFIX", "Bad-Prefix", "RESILIENT_TABLE_PREFIX="),
])
def test_invalid_flask_setting_fails_at_init_app_naming_the_key(
        key: str, value: object, named: str) -> None:
    flask_app = Flask(__name__)
    flask_app.config[key] = value
    rt = Resilient(_celery())
    with pytest.raises(ConfigurationError, match=named):
        rt.init_app(flask_app)
    assert EXTENSION_NAME not in flask_app.extensions


def test_init_app_after_settings_were_read_is_refused(tmp_path: Path) -> None:
    celery = _celery()
    celery.conf.resilient_store_url = f"sqlite:///{tmp_path}/s.db"
    rt = Resilient(celery)
    assert rt.config.store_url.endswith("s.db")
    flask_app = Flask(__name__)
    flask_app.config["RESILIENT_LEASE_SECONDS"] = 60
    with pytest.raises(ConfigurationError, match="before any task is sent"):
        rt.init_app(flask_app)
    assert rt.config.lease_seconds == 30.0


def test_one_flask_app_binds_one_runtime(tmp_path: Path) -> None:
    flask_app = Flask(__name__)
    flask_app.config["RESILIENT_STORE_URL"] = f"sqlite:///{tmp_path}/s.db"
    first = Resilient(_celery())
    first.init_app(flask_app)
    first.init_app(flask_app)  # the same runtime again: harmless
    with pytest.raises(ConfigurationError, match="already bound"):
        Resilient(_celery()).init_app(flask_app)
    assert flask_app.extensions[EXTENSION_NAME] is first


def test_init_app_takes_a_flask_app_only() -> None:
    with pytest.raises(ConfigurationError, match="Flask application"):
        Resilient(_celery()).init_app({"RESILIENT_STORE_URL": "sqlite:///x.db"})


def _flask_worker(nodes: NodeFactory, pg_url: str, table_prefix: str, redis_url: str,
                  queue_name: str) -> tuple[Store, LocalWorker]:
    """A migrated PostgreSQL store and a real worker of tests/contrib/flaskproj.py."""
    store = Store(pg_url, table_prefix)
    store.migrate()  # a server store is migrated by the operator, not by the worker
    env = {"FLASKPROJ_RESILIENT_STORE_URL": pg_url,
           "FLASKPROJ_RESILIENT_TABLE_PREFIX": table_prefix,
           "FLASKPROJ_BROKER": redis_url, "FLASKPROJ_QUEUE": queue_name,
           "FLASKPROJ_GREETING": "hello"}
    return store, nodes.worker("tests.contrib.flaskproj:celery_app", env=env,
                               queues=(queue_name,))


@pytest.mark.e2e
def test_celery_worker_of_a_flask_configured_app_runs_a_resumable_task(
        resilient_nodes: NodeFactory, effect_log: EffectLog, pg_url: str, table_prefix: str,
        redis_url: str, queue_name: str) -> None:
    store, worker = _flask_worker(resilient_nodes, pg_url, table_prefix, redis_url,
                                  queue_name)
    client = Celery("flaskproj-client", broker=redis_url, set_as_current=False)
    try:
        client.send_task("flaskproj.greet", args=(["ada", "bob"],), task_id="greet-1",
                         queue=queue_name)

        def state() -> str | None:
            row = store.get_work("greet-1")
            return None if row is None else row.state

        wait_for(lambda: state() == "done", 60, "the Flask project's task to finish")
        row = store.get_work("greet-1")
        assert row is not None and row.owner_node is not None
        assert row.owner_node.startswith("worker@")  # claimed by the worker process
        assert codec.decode(row.result_json) == ["hello, ada", "hello, bob"]
        checkpoint = store.load_checkpoint("greet-1")
        assert checkpoint is not None and checkpoint[1] == 2  # two durable checkpoints
        effect_log.assert_exactly_once({"greet:greet-1:ada", "greet:greet-1:bob"})
        assert "celery-resilient: store=postgresql+psycopg://postgres@" in worker.process.logs()
    finally:
        client.close()
        store.dispose()


def _flask_task_base(flask_app: Flask) -> type[Task]:
    class FlaskTask(Task):  # type: ignore[misc]  # Flask's documented pattern
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            with flask_app.app_context():
                return self.run(*args, **kwargs)

    return FlaskTask


def _super_calling_base(flask_app: Flask, calls: list[str]) -> type[ResumableTask]:
    class FlaskResumableTask(ResumableTask):  # the context opened, then super().__call__
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(self.request.id)
            with flask_app.app_context():
                return super().__call__(*args, **kwargs)

    return FlaskResumableTask


@pytest.mark.parametrize("order", ["flask-first", "resumable-first", "super-call"])
def test_flask_task_pattern_runs_under_the_claim(order: str, tmp_path: Path) -> None:
    flask_app = Flask(__name__)
    flask_app.config.update(RESILIENT_STORE_URL=f"sqlite:///{tmp_path}/s.db", GREETING="hi")
    celery = _celery()
    rt = Resilient(celery)
    rt.init_app(flask_app)
    flask_task = _flask_task_base(flask_app)
    calls: list[str] = []
    bases = {"flask-first": (flask_task, ResumableTask),
             "resumable-first": (ResumableTask, flask_task),
             "super-call": (_super_calling_base(flask_app, calls),)}[order]
    base = type("FlaskResumable", bases, {})

    @celery.task(base=base, bind=True, shared=False, name=f"flask_test.greet_{order}")
    def greet(self: ResumableTask, name: str) -> str:
        self.checkpoint.save({"name": name})
        return f"{current_app.config['GREETING']}, {name} ({self.work_key})"

    try:
        result = greet.apply(args=("ada",), task_id=f"fp-{order}").get()
        assert result == f"hi, ada (fp-{order})"
        row = rt.store.get_work(f"fp-{order}")
        assert row is not None and row.state == "done" and row.epoch == 1
        assert rt.store.load_checkpoint(f"fp-{order}") is not None
        assert greet("bob").startswith("hi, bob (")  # a direct call: the body, in the context
        if order == "super-call":
            assert len(calls) == 2  # once per run: the claim's super() call did not recurse
    finally:
        rt.store.dispose()


@pytest.mark.e2e
def test_flask_task_pattern_resumes_after_sigkill_and_finishes_once(
        resilient_nodes: NodeFactory, effect_log: EffectLog, pg_url: str, table_prefix: str,
        redis_url: str, queue_name: str) -> None:
    store, worker = _flask_worker(resilient_nodes, pg_url, table_prefix, redis_url,
                                  queue_name)
    client = Celery("flaskproj-client", broker=redis_url, set_as_current=False)

    def checkpointed() -> int:
        found = store.load_checkpoint("count-1")
        return 0 if found is None else int(codec.decode(found[0])["i"])

    def state() -> str | None:
        row = store.get_work("count-1")
        return None if row is None else row.state

    try:
        client.send_task("flaskproj.count", args=(12, 0.25), task_id="count-1",
                         queue=queue_name)
        wait_for(lambda: checkpointed() >= 3, 60, "3 checkpointed steps")
        worker.kill("SIGKILL")
        saved = checkpointed()
        assert state() == "running"
        worker.restart()
        wait_for(lambda: state() == "done", 60, "the work to finish after the restart")
        row = store.get_work("count-1")
        assert row is not None and row.epoch == 2 and row.attempts == 2
        assert codec.decode(row.result_json) == {"n": 12, "greeting": "hello"}
        starts = [e["i"] for e in effect_log.entries("start:count-1")]
        assert starts == [0, saved], "did not resume from the last durable checkpoint"
        counts = effect_log.counts()
        for i in range(12):  # the step in flight at the kill may run twice, no other
            assert counts[f"step:count-1:{i}"] in ((1, 2) if i == saved else (1,)), (
                f"step {i} ran {counts[f'step:count-1:{i}']} times")
        assert "exist only while the task runs" not in worker.process.logs()
        assert "Context impl" not in worker.process.logs()  # Alembic's chatter is below INFO
    finally:
        client.close()
        store.dispose()
