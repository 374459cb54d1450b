"""Takes of many deliveries in one round trip, made by the worker's main process.

The main process takes the claims of a batch of deliveries before it hands them to the pool,
so a pool process starts the body with its epoch in hand instead of waiting for a take of
its own. Only the common case is taken here: a key with no row yet, or a ``reserved`` or
``requeued`` claim with compatible arguments, under the death cap, its try current, not
handed to a replacement, its task id not revoked. A delivery whose key is not taken here
goes to the pool without a claim and its pool process makes the careful take
(:meth:`celery_resilient.store.sql.Store.take`), which decides every other case.

A claim taken here is ``running`` with ``owner_pid`` :data:`UNSTARTED_PID` until its pool
process starts the body: the main process marks it started (the pool process's PID) with a
later batch, when the pool accepted it. A running claim still unstarted was taken but never
known to start: its takeover after a whole-worker death counts no death (see
:func:`celery_resilient.core.take.decide_take`), and its own worker treats it as live (it
holds the request).

On PostgreSQL a batch is one statement over JSON arrays of rows: one parse and one commit
for the whole batch. On SQLite (in-process) it is one ``BEGIN IMMEDIATE`` transaction of
single-row statements.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from celery_resilient.core.states import DONE, REQUEUED, RESERVED, RUNNING, UNSTARTED_PID
from celery_resilient.store.dialect import Dialect


@dataclass(frozen=True)
class TakeRequest:
    """A delivery the main process takes the claim of before dispatching it."""

    work_key: str
    task_name: str
    task_id: str
    retries: int
    #: The epoch a re-sent message was sent to replace (its ``resilient_supersedes``).
    supersedes: int | None
    args_digest: str | None
    #: The delivered message, kept for a re-publish when the key has no row yet.
    message_json: str | None


@dataclass(frozen=True)
class Started:
    """A claim taken by a batch whose pool process accepted its request (``pid``), or, with
    ``pid`` None, whose pool process died running it: its owner is cleared, so the next
    take of the work counts a death."""

    work_key: str
    epoch: int
    pid: int | None


@dataclass(frozen=True)
class Finish:
    """A body's result handed by its pool process (``tasks/handed_results.py``), for the main
    process to commit as ``done`` under its claim."""

    work_key: str
    epoch: int
    result_json: str | None


#: Columns every taken row returns, in this order (the careful take's ``Resume`` inputs).
TAKEN_COLUMNS = ("work_key", "epoch", "attempts", "deaths", "checkpoint_json",
                 "checkpoint_seq", "checkpoint_epoch", "checkpoint_takes", "old_state_json",
                 "old_seq")


def take_params(t: TakeRequest, node: str, inc: str, lease: float,
                max_attempts: int) -> dict[str, Any]:
    """The bound values of one take's single-row statements (SQLite's and MySQL's batches)."""
    return {"key": t.work_key, "name": t.task_name, "task_id": t.task_id,
            "digest": t.args_digest, "retries": t.retries, "supersedes": t.supersedes,
            "message": t.message_json, "node": node, "inc": inc, "lease": lease,
            "max_attempts": max_attempts}


class BatchedTakes:
    """The batch take and the started marks, as SQL for one store's tables."""

    def __init__(self, t: Any, dialect: Dialect) -> None:
        self.dialect = dialect
        now = str(dialect.now())
        work, rv, old, fg = (t.work.name, t.revocations.name, t.old_checkpoints.name,
                             t.forgotten.name)
        old_cols = (f"(SELECT o.state_json FROM {old} o WHERE o.work_key = w.work_key) "
                    "AS old_state_json, "
                    f"(SELECT o.seq FROM {old} o WHERE o.work_key = w.work_key) AS old_seq")
        taken = ("w.work_key, w.epoch, w.attempts, w.deaths, w.checkpoint_json, "
                 f"w.checkpoint_seq, w.checkpoint_epoch, w.checkpoint_takes, {old_cols}")
        takeable = (f"w.state IN ('{RESERVED}', '{REQUEUED}') "
                    "AND w.deaths < {max_attempts} "
                    "AND (w.args_digest IS NULL OR {digest} IS NULL OR w.args_digest = {digest}) "
                    "AND w.retries <= {retries} "
                    "AND (w.handed_to IS NULL OR w.handed_to = {supersedes}) "
                    f"AND NOT EXISTS (SELECT 1 FROM {rv} r WHERE r.task_id = {{task_id}}"
                    "{revoked_among})")
        set_running = (f"state = '{RUNNING}', epoch = w.epoch + 1, owner_node = {{node}}, "
                       f"incarnation = {{inc}}, owner_pid = {UNSTARTED_PID}, "
                       f"lease_expires_at = {now} + {{lease}}, attempts = w.attempts + 1, "
                       "task_id = {task_id}, error = NULL, "
                       "checkpoint_takes = w.checkpoint_takes + 1, retries = {retries}, "
                       "handed_to = NULL, args_digest = COALESCE(w.args_digest, {digest}), "
                       f"updated_at = {now}")
        insert_cols = ("work_key, task_name, task_id, args_digest, state, epoch, owner_node, "
                       "incarnation, owner_pid, lease_expires_at, attempts, deaths, "
                       "republished, retries, message_json, created_at, updated_at, "
                       "checkpoint_seq, checkpoint_takes")
        first_epoch = (f"COALESCE((SELECT f.epoch FROM {fg} f WHERE f.work_key = {{key}}), 0) "
                       "+ 1")
        insert_values = (f"{{key}}, {{name}}, {{task_id}}, {{digest}}, '{RUNNING}', "
                         f"{first_epoch}, {{node}}, {{inc}}, {UNSTARTED_PID}, "
                         f"{now} + {{lease}}, 1, 0, 0, "
                         f"{{retries}}, {{message}}, {now}, {now}, 0, 0")
        inserted = "work_key, epoch, attempts, deaths, NULL, 0, NULL, 0, NULL, NULL"
        if dialect.is_sqlite:
            p = {name: f":{name}" for name in ("key", "name", "task_id", "digest", "retries",
                                               "supersedes", "message", "node", "inc", "lease",
                                               "max_attempts")}
            p["revoked_among"] = ""
            self.sqlite_update = (
                f"UPDATE {work} AS w SET {set_running.format(**p)} "
                f"WHERE w.work_key = :key AND {takeable.format(**p)} RETURNING "
                # SQLite's RETURNING names columns without their table: the old table's
                # row is matched on the bound key (as in HotStatements.take_fast).
                + taken.replace("o.work_key = w.work_key", "o.work_key = :key")
                .replace("w.", ""))
            self.sqlite_insert = (
                f"INSERT INTO {work} ({insert_cols}) SELECT {insert_values.format(**p)} "
                f"WHERE NOT EXISTS (SELECT 1 FROM {rv} r WHERE r.task_id = :task_id) "
                f"ON CONFLICT (work_key) DO NOTHING RETURNING {inserted}")
            self.sqlite_started = (
                f"UPDATE {work} SET owner_pid = :pid WHERE work_key = :key AND epoch = :epoch "
                f"AND state = '{RUNNING}' AND owner_pid = {UNSTARTED_PID}")
            self.sqlite_lost = (
                f"UPDATE {work} SET incarnation = NULL, owner_pid = NULL, "
                f"lease_expires_at = {now} WHERE work_key = :key AND epoch = :epoch "
                f"AND state = '{RUNNING}' AND incarnation = :inc")
            return
        i = {"key": "i.work_key", "name": "i.task_name", "task_id": "i.task_id",
             "digest": "i.digest", "retries": "i.retries", "supersedes": "i.supersedes",
             "message": "i.message_json", "node": "%(node)s", "inc": "%(inc)s",
             "lease": "%(lease)s", "max_attempts": "%(max_attempts)s",
             "revoked_among": " AND r.task_id = ANY(%(task_ids)s::text[])"}
        # The statement's parts: only those a batch has rows for are sent (below), because
        # planning is most of what a small batch costs the server.
        # The marks' rows a transaction holds are skipped (a body's ledger.atomic() holds
        # its row until it commits): the batch must not wait on it with every other
        # delivery's take behind it. They come back as held (below), for a later batch.
        self._marked = (
            f"marked AS (SELECT work_key FROM {work} "
            "WHERE work_key = ANY(%(mark_keys)s::text[]) FOR NO KEY UPDATE SKIP LOCKED)")
        self._held = (
            "SELECT NULL::boolean, k, NULL::bigint, NULL::int, NULL::int, NULL::text, "
            "NULL::bigint, NULL::bigint, NULL::bigint, NULL::text, NULL::bigint "
            "FROM unnest(%(mark_keys)s::text[]) AS k "
            "WHERE k NOT IN (SELECT work_key FROM marked) "
            f"AND EXISTS (SELECT 1 FROM {work} w WHERE w.work_key = k)")
        self._started = (
            f"started AS (UPDATE {work} AS w SET owner_pid = s.pid "
            "FROM (SELECT e->>0 AS work_key, (e->>1)::bigint AS epoch, (e->>2)::int AS pid "
            "FROM json_array_elements(%(started)s::json) AS e) AS s "
            f"WHERE w.work_key = s.work_key AND w.epoch = s.epoch AND w.state = '{RUNNING}' "
            f"AND w.owner_pid = {UNSTARTED_PID} "
            "AND w.work_key = ANY(%(started_keys)s::text[]) "
            "AND w.work_key IN (SELECT work_key FROM marked) RETURNING 1)")
        self._lost = (
            f"lost AS (UPDATE {work} AS w SET incarnation = NULL, owner_pid = NULL, "
            f"lease_expires_at = {now} "
            "FROM (SELECT e->>0 AS work_key, (e->>1)::bigint AS epoch "
            "FROM json_array_elements(%(lost)s::json) AS e) AS l "
            f"WHERE w.work_key = l.work_key AND w.epoch = l.epoch AND w.state = '{RUNNING}' "
            "AND w.incarnation = %(inc)s AND w.work_key = ANY(%(lost_keys)s::text[]) "
            "AND w.work_key IN (SELECT work_key FROM marked) RETURNING 1)")
        self._takes = (
            # The rows come as JSON arrays of arrays (one parameter each): psycopg dumps a
            # text in C where a list of texts costs Python work per element.
            "i AS (SELECT e->>0 AS work_key, e->>1 AS task_name, e->>2 AS task_id, "
            "e->>3 AS digest, (e->>4)::int AS retries, (e->>5)::bigint AS supersedes, "
            "e->>6 AS message_json FROM json_array_elements(%(takes)s::json) AS e), "
            f"upd AS (UPDATE {work} AS w SET {set_running.format(**i)} FROM i "
            "WHERE w.work_key = i.work_key AND w.work_key = ANY(%(keys)s::text[]) "
            f"AND {takeable.format(**i)} RETURNING {taken}), "
            f"ins AS (INSERT INTO {work} ({insert_cols}) "
            f"SELECT {insert_values.format(**i)} FROM i "
            f"WHERE NOT EXISTS (SELECT 1 FROM {work} w WHERE w.work_key = i.work_key) "
            f"AND NOT EXISTS (SELECT 1 FROM {rv} r WHERE r.task_id = i.task_id "
            "AND r.task_id = ANY(%(task_ids)s::text[])) "
            "ON CONFLICT (work_key) DO NOTHING RETURNING work_key, epoch, attempts, deaths, "
            "NULL::text, 0::bigint, NULL::bigint, 0::bigint, NULL::text, NULL::bigint)")
        # Results handed by pool processes: ``done`` under the epoch they ran with, as the
        # pool process's own finish (HotStatements.close) would write it.
        self._finishes = (
            f"fin AS (UPDATE {work} AS w SET state = '{DONE}', result_json = f.result_json, "
            "error = NULL, owner_pid = NULL, lease_expires_at = NULL, "
            f"updated_at = {now}, finished_at = {now} "
            "FROM (SELECT e->>0 AS work_key, (e->>1)::bigint AS epoch, e->>2 AS result_json "
            "FROM json_array_elements(%(finishes)s::json) AS e) AS f "
            f"WHERE w.work_key = f.work_key AND w.epoch = f.epoch AND w.state = '{RUNNING}' "
            "AND w.work_key = ANY(%(finish_keys)s::text[]) RETURNING w.work_key)")
        self._pg_statements: dict[tuple[bool, bool, bool, bool], str] = {}

    def pg_statement(self, started: bool, lost: bool, takes: bool, finishes: bool) -> str:
        """The batch statement with only the parts that have rows: one statement, so one
        transaction, whatever it holds; built once per combination (16 at most)."""
        parts = (started, lost, takes, finishes)
        made = self._pg_statements.get(parts)
        if made is not None:
            return made
        ctes = [sql for sql, wanted in ((self._marked, started or lost),
                                        (self._started, started), (self._lost, lost),
                                        (self._takes, takes), (self._finishes, finishes))
                if wanted]
        # A data-modifying CTE runs to completion whether or not the query reads it.
        selects = ["SELECT true, work_key, epoch, attempts, deaths, checkpoint_json, "
                   "checkpoint_seq, checkpoint_epoch, checkpoint_takes, old_state_json, "
                   "old_seq FROM upd", "SELECT true, * FROM ins"] if takes else []
        if finishes:
            selects.append("SELECT false, work_key, NULL::bigint, NULL::int, NULL::int, "
                           "NULL::text, NULL::bigint, NULL::bigint, NULL::bigint, NULL::text, "
                           "NULL::bigint FROM fin")
        if started or lost:
            selects.append(self._held)
        made = (f"WITH {', '.join(ctes)} " if ctes else "") + (
            " UNION ALL ".join(selects) if selects else "SELECT false WHERE false")
        self._pg_statements[parts] = made
        return made

    def run(self, conn: Connection, takes: Sequence[TakeRequest], started: Sequence[Started],
            node: str, inc: str, lease: float, max_attempts: int,
            finishes: Sequence[Finish] = (), deferred: list[Started] | None = None,
            ) -> tuple[list[dict[str, Any]], set[str]]:
        """Take what can be taken of ``takes`` (one row each, unique keys), mark ``started``
        and commit ``finishes`` (PostgreSQL only; keys apart from those of the takes and
        marks: one row is changed once per statement); the rows taken, as dicts of
        :data:`TAKEN_COLUMNS`, and the keys finished (a finish whose claim moved on is not).
        A mark whose row another transaction holds is not written (nor waited for) but
        appended to ``deferred``, on PostgreSQL and MySQL; SQLite has one writer.

        PostgreSQL: ``conn`` is autocommitted and the statement is its own transaction.
        SQLite: ``conn`` is inside a writing transaction the caller commits."""
        if self.dialect.is_sqlite:
            if finishes:
                raise ValueError("finishes are committed by the main process on PostgreSQL "
                                 "only")
            return self._run_sqlite(conn, takes, started, node, inc, lease,
                                    max_attempts), set()
        params = {
            "started": json.dumps([[s.work_key, s.epoch, s.pid] for s in started
                                   if s.pid is not None]),
            "lost": json.dumps([[s.work_key, s.epoch] for s in started if s.pid is None]),
            "takes": json.dumps([[t.work_key, t.task_name, t.task_id, t.args_digest, t.retries,
                                  t.supersedes, t.message_json] for t in takes]),
            # The same keys again as arrays: the planner sees how many rows each part
            # touches and finds them by index (it guesses 100 for a JSON array, and past a
            # few thousand rows a table with no statistics yet was scanned whole).
            "keys": [t.work_key for t in takes], "task_ids": [t.task_id for t in takes],
            "started_keys": [s.work_key for s in started if s.pid is not None],
            "lost_keys": [s.work_key for s in started if s.pid is None],
            "mark_keys": list({s.work_key for s in started}),
            "finishes": json.dumps([[f.work_key, f.epoch, f.result_json] for f in finishes]),
            "finish_keys": [f.work_key for f in finishes],
            "node": node, "inc": inc, "lease": lease, "max_attempts": max_attempts,
        }
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        try:
            cursor.execute(self.pg_statement(
                bool(params["started_keys"]), bool(params["lost_keys"]), bool(takes),
                bool(finishes)), params)
            taken, finished, held = [], set(), set()
            for row in cursor.fetchall():
                if row[0] is None:
                    held.add(row[1])
                elif row[0]:
                    taken.append(dict(zip(TAKEN_COLUMNS, row[1:], strict=True)))
                else:
                    finished.add(row[1])
            if held and deferred is not None:
                deferred.extend(s for s in started if s.work_key in held)
            return taken, finished
        finally:
            cursor.close()

    def _run_sqlite(self, conn: Connection, takes: Sequence[TakeRequest],
                    started: Sequence[Started], node: str, inc: str, lease: float,
                    max_attempts: int) -> list[dict[str, Any]]:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        try:
            for s in started:
                cursor.execute(self.sqlite_started if s.pid is not None else self.sqlite_lost,
                               {"key": s.work_key, "epoch": s.epoch, "pid": s.pid,
                                "inc": inc})
            rows: list[dict[str, Any]] = []
            for t in takes:
                params = take_params(t, node, inc, lease, max_attempts)
                row = cursor.execute(self.sqlite_update, params).fetchone()
                if row is None:
                    row = cursor.execute(self.sqlite_insert, params).fetchone()
                if row is not None:
                    rows.append(dict(zip(TAKEN_COLUMNS, row, strict=True)))
            return rows
        finally:
            cursor.close()
