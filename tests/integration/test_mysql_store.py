"""What only the MySQL/MariaDB store has to get right: its sessions' settings, and InnoDB's
lock conflicts treated as transient (re-run in place, never a task's failure). The contract
itself runs on MariaDB with every other dialect (``test_store_contract.py``)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import MySQLdb.connections  # type: ignore[import-untyped]
import pymysql.connections
import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from celery_resilient.core.states import UNSTARTED_PID
from celery_resilient.errors import StoreUnavailable
from celery_resilient.store import packet_limit, transient
from celery_resilient.store.batched_takes import Started, TakeRequest
from celery_resilient.store.sql import SESSION_ALIVE, UNJUDGED, Store
from celery_resilient.testing.services import ThrowawayMariaDB, drop_prefixed_tables
from celery_resilient.testing.waiting import wait_for

from .helpers import owner, run, started


@pytest.fixture
def other(mysql_url: str) -> Iterator[Engine]:
    """Connections of a concurrent client (another worker, the user's own application)."""
    engine = create_engine(mysql_url)
    yield engine
    engine.dispose()


def test_every_store_session_is_utc_read_committed_utf8mb4(mysql_store: Store) -> None:
    for engine in mysql_store.engines:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT @@time_zone, @@tx_isolation, "
                                    "@@character_set_client")).one()
            conn.rollback()
        assert tuple(row) == ("+00:00", "READ-COMMITTED", "utf8mb4"), engine


def test_a_lock_wait_timeout_is_run_again_in_place(mysql_store: Store, other: Engine,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A row another transaction holds past ``innodb_lock_wait_timeout`` (1205) is a
    transient conflict: the heartbeat runs again once the holder lets go, and succeeds."""
    me = started(mysql_store, owner())

    @event.listens_for(mysql_store.engine, "connect")
    def _short_waits(dbapi_conn: object, _record: object) -> None:
        cur = dbapi_conn.cursor()  # type: ignore[attr-defined]
        cur.execute("SET SESSION innodb_lock_wait_timeout = 1")
        cur.close()

    mysql_store.engine.dispose()  # the pool's connections get the setting
    wk = mysql_store.t.workers
    caplog.set_level(logging.INFO, logger="celery_resilient.store.guard")
    holder = other.connect()
    holder.execute(text(f"SELECT 1 FROM {wk.name} WHERE incarnation = :i FOR UPDATE"),
                   {"i": me.incarnation})

    def release_after_the_first_rerun() -> None:
        wait_for(lambda: any(getattr(r, "action", None) == "store_rerun"
                             for r in caplog.records), 30, "a re-run")
        holder.rollback()

    releaser = threading.Thread(target=release_after_the_first_rerun)
    releaser.start()
    try:
        assert mysql_store.heartbeat(me, 30) is True
    finally:
        releaser.join(30)
        holder.close()
    reruns = [r for r in caplog.records if getattr(r, "action", None) == "store_rerun"]
    assert reruns and "lock wait timeout (MySQL error 1205)" in reruns[0].getMessage()


def test_a_deadlock_innodb_breaks_is_retryable(mysql_store: Store, other: Engine) -> None:
    """Two transactions locking two rows in opposite orders: InnoDB rolls one back (1213),
    which the store classifies as retryable (its operations run it again in place)."""
    for key in ("a", "b"):
        mysql_store.record_receipt(key, "proj.task", f"tid-{key}", None, "{}", owner(), 30)
    w = mysql_store.t.work.name
    lock = text(f"UPDATE {w} SET attempts = attempts + 1 WHERE work_key = :k")
    first, second = other.connect(), other.connect()
    first.execute(lock, {"k": "a"})
    second.execute(lock, {"k": "b"})
    errors: list[BaseException] = []

    def cross(conn: object, key: str) -> None:
        try:
            conn.execute(lock, {"k": key})  # type: ignore[attr-defined]
        except DBAPIError as exc:
            errors.append(exc)
            conn.rollback()  # type: ignore[attr-defined]

    thread = threading.Thread(target=cross, args=(first, "b"))
    thread.start()
    cross(second, "a")
    thread.join(30)
    first.rollback()
    second.rollback()
    first.close()
    second.close()
    assert len(errors) == 1, errors
    assert transient.mysql_errno(errors[0]) == 1213
    assert transient.is_retryable(errors[0]) and transient.is_transient(errors[0])
    assert transient.describe(errors[0]) == "deadlock found (MySQL error 1213)"


def _count_commands(monkeypatch: pytest.MonkeyPatch, store: Store, sent: list[str]) -> None:
    """Record every command the store's driver sends (the wrappers change nothing): PyMySQL's
    one command method, or mysqlclient's query, commit and rollback."""
    if make_url(store.url).get_driver_name() == "mysqldb":
        connection = MySQLdb.connections.Connection

        def wrap(name: str) -> None:
            method = getattr(connection, name)

            def counted(self: object, *args: object) -> object:
                sql = args[0] if args else name.upper()
                sent.append(sql.decode() if isinstance(sql, bytes) else str(sql))
                return method(self, *args)

            monkeypatch.setattr(connection, name, counted)

        for name in ("query", "commit", "rollback"):
            wrap(name)
        return
    command = pymysql.connections.Connection._execute_command

    def counted(self: object, cmd: int, sql: object) -> object:
        sent.append(sql.decode() if isinstance(sql, bytes) else str(sql))
        return command(self, cmd, sql)  # type: ignore[arg-type]

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", counted)


def test_the_per_task_statements_are_one_round_trip_each(
        mysql_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on PostgreSQL: the take (its UPDATE, the read of its row and COMMIT in one packet),
    a checkpoint save and the finish each cost one command to the server, counted at the
    driver on a pooled connection, whichever driver the URL names."""
    me = started(mysql_store, owner())
    for key in ("warm", "k"):
        mysql_store.record_receipt(key, "proj.task", f"tid-{key}", None, "{}", me, 30)
    warm = run(mysql_store, "warm", me, task_id="tid-warm")  # the autocommit pool connects
    mysql_store.finish("warm", warm.epoch, None)
    sent: list[str] = []
    _count_commands(monkeypatch, mysql_store, sent)
    claim = run(mysql_store, "k", me, task_id="tid-k")
    assert len(sent) == 1 and sent[0].startswith("START TRANSACTION; UPDATE"), sent
    sent.clear()
    assert mysql_store.save_checkpoint("k", claim.epoch, '{"row": 1}') == 1
    assert len(sent) == 1, sent
    sent.clear()
    mysql_store.finish("k", claim.epoch, '"ok"')
    assert len(sent) == 1, sent
    monkeypatch.undo()
    row = mysql_store.get_work("k")
    assert row is not None and (row.state, row.epoch, row.result_json) == ("done", 1, '"ok"')
    assert mysql_store.load_checkpoint("k") == ('{"row": 1}', 1)


def _taken(store: Store, me: object, keys: list[str], started: list[Started] | None = None,
           ) -> dict[str, Any]:
    takes = [TakeRequest(k, "proj.task", f"tid-{k}", 0, None, None, f'{{"m": "{k}"}}')
             for k in keys]
    claims, _ = store.take_batch(takes, started or [], me, 30.0, 5)  # type: ignore[arg-type]
    return claims


def test_a_batch_of_takes_is_one_round_trip_and_one_more_with_marks(
        mysql_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight takes (new keys, reserved claims with a checkpoint, one the careful take must
    decide) in one packet with its transaction's begin and commit; with marks, the read
    that locks the marks' rows first. Counted at the driver, whichever the URL names."""
    me = started(mysql_store, owner())
    for key in ("r0", "r1", "r2"):
        mysql_store.record_receipt(key, "proj.task", f"tid-{key}", None, "{}", me, 30)
    done = run(mysql_store, "done", me, task_id="tid-done")
    mysql_store.finish("done", done.epoch, None)
    _taken(mysql_store, me, ["warm"])  # the autocommit pool connects
    sent: list[str] = []
    _count_commands(monkeypatch, mysql_store, sent)
    claims = _taken(mysql_store, me, ["n0", "n1", "n2", "n3", "r0", "r1", "r2", "done"])
    assert len(sent) == 1 and sent[0].startswith("START TRANSACTION;"), sent
    assert sent[0].endswith("COMMIT"), sent[0][-200:]
    assert sorted(claims) == ["n0", "n1", "n2", "n3", "r0", "r1", "r2"]
    sent.clear()
    marks = [Started(k, claims[k].epoch, 4242) for k in ("n0", "r1")]
    _taken(mysql_store, me, ["n4", "n5"], marks)
    assert len(sent) == 2, sent
    monkeypatch.undo()
    for key, claim in claims.items():
        row = mysql_store.get_work(key)
        assert row is not None and (row.state, row.epoch) == ("running", claim.epoch), row
        assert row.owner_pid == (4242 if key in ("n0", "r1") else UNSTARTED_PID), row
    assert mysql_store.get_work("done").state == "done"  # type: ignore[union-attr]
    assert {mysql_store.get_work(k).state for k in ("n4", "n5")} == {"running"}  # type: ignore[union-attr]


def test_a_batch_over_the_packet_limit_goes_in_several_packets_of_one_transaction(
        mysql_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each take fits, the batch does not: it is split between statements, every take is
    still made, and the split packets are one transaction (the COMMIT only in the last)."""
    me = started(mysql_store, owner())
    _taken(mysql_store, me, ["warm"])
    with mysql_store.single() as conn:  # the pooled session the batch will use
        real = conn.info[packet_limit.INFO_KEY]
        conn.info[packet_limit.INFO_KEY] = 12_000  # as if the server allowed this much
    try:
        sent: list[str] = []
        _count_commands(monkeypatch, mysql_store, sent)
        keys = [f"k{i}" for i in range(8)]
        claims = _taken(mysql_store, me, keys)
        monkeypatch.undo()
    finally:
        with mysql_store.single() as conn:
            conn.info[packet_limit.INFO_KEY] = real
    assert sorted(claims) == keys
    assert len(sent) >= 3, [len(p) for p in sent]
    assert all(len(p.encode()) <= 12_000 for p in sent), [len(p) for p in sent]
    assert [p.count("COMMIT") for p in sent] == [0] * (len(sent) - 1) + [1]
    for key in keys:
        row = mysql_store.get_work(key)
        assert row is not None and (row.state, row.epoch) == ("running", claims[key].epoch)


def _interrupt(*_: object) -> None:
    raise SoftTimeLimitExceeded()  # from a signal handler, as billiard raises it


@pytest.mark.parametrize("path", ["begin", "single", "reading"])
def test_an_interrupt_mid_statement_reaches_the_caller_and_no_reply_is_served_twice(
        mysql_store: Store, path: str) -> None:
    """A soft time limit raised while PyMySQL waits for a reply: the caller sees it, and the
    connection left mid-reply never answers another call (the next ones read their own)."""
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(SoftTimeLimitExceeded), getattr(mysql_store, path)() as conn:
            conn.execute(text("SELECT SLEEP(2)"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    for n in range(4):
        with getattr(mysql_store, path)() as conn:
            assert conn.execute(text("SELECT :n"), {"n": n}).scalar_one() == n


def test_statement_listeners_see_each_statement_of_the_take(mysql_store: Store) -> None:
    """With a tracer listening (OpenTelemetry, Sentry), the take is sent statement by
    statement inside its own transaction, so the tracer sees each one."""
    seen: list[str] = []

    def listen(_c: object, _cur: object, statement: str, *_: object) -> None:
        seen.append(statement.split(maxsplit=1)[0])

    for engine in mysql_store.engines:
        event.listen(engine, "before_cursor_execute", listen)
    me = started(mysql_store, owner())
    mysql_store.record_receipt("k", "proj.task", "tid-k", None, "{}", me, 30)
    seen.clear()
    claim = run(mysql_store, "k", me, task_id="tid-k")
    assert seen == ["START", "UPDATE", "SELECT", "COMMIT"] and claim.epoch == 1
    row = mysql_store.get_work("k")
    assert row is not None and (row.state, row.epoch, row.incarnation) == (
        "running", 1, me.incarnation)


HOLDER = """
import sys, time
from celery_resilient.store.liveness import session_lock
lock = session_lock(sys.argv[1], sys.argv[2], sys.argv[3])
print(lock.acquire(), flush=True)
time.sleep(600)
"""


def test_a_server_restart_frees_every_lock_and_proves_nothing(table_prefix: str) -> None:
    """A restart (or a failover) frees every named lock: a lock taken before it proves
    nothing (the recorded server start no longer matches), the pool's dead connections are
    replaced on use, and the store says the server has just started. (Starts are known to
    the second: a server restarted within 2 s of its previous start is not told apart, so
    this one has run for 3 s first; docs/reliability.md.)"""
    server = ThrowawayMariaDB().init()
    server.start()
    store = Store(server.url, table_prefix)
    holder: subprocess.Popen[str] | None = None
    try:
        store.migrate()
        me, other = owner("w@a"), owner("w@b")
        for who in (me, other):
            store.register(who, "", 30)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, server.url, table_prefix,
                                   other.incarnation], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None
        store.record_liveness(other, float(holder.stdout.readline()))
        assert store.prove_dead(other.incarnation) == SESSION_ALIVE
        assert store.lock_suspects(me, 0) == [other.incarnation]
        wait_for(lambda: (store.up_for() or 0) >= 3, 30, "the server's first 3 s")
        server.stop_immediately()
        server.start()
        up = store.up_for()  # a pooled connection died with the server: replaced on use
        assert up is not None and up < 60
        assert store.lock_suspects(me, 0) == []
        assert store.prove_dead(other.incarnation) == UNJUDGED, "a lock the restart freed"
        assert run(store, "k", me).epoch == 1
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
            assert holder.stdout is not None
            holder.stdout.close()
        store.dispose()
        server.destroy()


@pytest.mark.parametrize("charset", ["utf8", "utf8mb3", "latin1"])
def test_a_url_naming_a_narrower_charset_still_stores_any_character(
        mysql_url: str, table_prefix: str, charset: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Django's old default OPTIONS charset ``utf8`` (utf8mb3), or ``latin1``: the store's
    sessions are ``utf8mb4`` all the same (with a warning naming the change), so a task id
    and a work key outside the narrower set are taken by a batch and stored as given."""
    url = f"{mysql_url}{'&' if '?' in mysql_url else '?'}charset={charset}"
    s = Store(url, table_prefix)
    try:
        with caplog.at_level(logging.WARNING, logger="celery_resilient.store.engine"):
            s.migrate()
        assert f"charset utf8mb4, not {charset}" in caplog.text
        for engine in s.engines:
            with engine.connect() as conn:
                assert conn.execute(text("SELECT @@character_set_client")).scalar_one() \
                    == "utf8mb4"
                conn.rollback()
        key = "order-\N{GRINNING FACE}-\u00e9\u4e2d"
        me = started(s, owner())
        take = TakeRequest(key, "proj.task", f"tid-{key}", 0, None, None, '{"m": 1}')
        claims, _ = s.take_batch([take], [], me, 30.0, 5)
        assert set(claims) == {key}
        row = s.get_work(key)
        assert row is not None and row.task_id == f"tid-{key}" and row.state == "running"
    finally:
        s.dispose()
        drop_prefixed_tables(mysql_url, table_prefix)


@pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])
def test_writes_a_read_only_server_refuses_are_a_store_outage_on_either_driver(
        driver: str, table_prefix: str) -> None:
    """A replica after a failover refuses every write (error 1290). Each take path (the
    one-packet take, the careful take, a batch of takes) and a checkpoint save must report
    that as the store being unavailable, which re-sends the task, never as the task's own
    error, which fails it and loses the work. On mysqlclient the take's cleanup once read
    the failed session's leftover reply and raised that instead (error 2006)."""
    server = ThrowawayMariaDB().init()
    server.start()
    store = Store(make_url(server.app_url).set(drivername=f"mysql+{driver}")
                  .render_as_string(hide_password=False), table_prefix)
    try:
        store.migrate()
        me = started(store, owner())
        saving = run(store, "saving", me, task_id="tid-saving")
        for key in ("fast", "batched"):
            store.record_receipt(key, "proj.task", f"tid-{key}", None, "{}", me, 30)
        server.read_only(True)
        for attempt in (lambda: run(store, "fast", me, task_id="tid-fast"),
                        lambda: run(store, "new", me, task_id="tid-new"),
                        lambda: store.save_checkpoint("saving", saving.epoch, '{"n": 1}')):
            with pytest.raises(StoreUnavailable, match="1290"):
                attempt()
        with pytest.raises(DBAPIError, match="1290"):  # the dispatcher's: logged, not retried
            _taken(store, me, ["batched"])
        server.read_only(False)
        assert run(store, "fast", me, task_id="tid-fast").epoch == 1
        assert sorted(_taken(store, me, ["batched", "new"])) == ["batched", "new"]
        assert store.save_checkpoint("saving", saving.epoch, '{"n": 1}') == 1
    finally:
        store.dispose()
        server.destroy()
