"""Every query for beat slots: ``schedule_runs`` (one row per slot) and ``schedule_markers``.

A slot is claimed (row inserted, state ``claimed``) in the same transaction that moves the
entry's marker past it; the message is published after that commits, then the row is marked
``sent``. The primary key (entry, slot) makes a second claim of the same slot impossible, so two
beats never both send it; a ``claimed`` row left by a dead beat is taken over (compare-and-set
on its owner) and sent again with the same task id.

A worker about to run a plain (non-resumable) task for a slot moves its row to ``started``
(from ``claimed`` or ``sent``: the message exists, so it was published) and records itself as
the owner; a second copy of the slot's message finds the row ``started`` and runs nothing
(:mod:`celery_resilient.beat.once`). A ``started`` row is never re-sent by a beat.

Slots are float seconds since the epoch (see :mod:`celery_resilient.beat.windows`): integer
microseconds divided by 10**6, which round-trip exactly through both dialects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Float,
    String,
    and_,
    any_,
    bindparam,
    case,
    delete,
    false,
    func,
    literal,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from celery_resilient.core.states import CLAIMED, SENT, SKIPPED, STARTED
from celery_resilient.store import retention
from celery_resilient.store.db import Database
from celery_resilient.store.guard import guarded

CHUNK = 400  # rows per multi-row statement: far below every dialect's parameter limit
SEND_CHUNK = 5000  # slots per PostgreSQL UPDATE (one array parameter)
_COLUMNS = ("entry", "slot", "state", "task_id", "owner", "claimed_at")


@dataclass(frozen=True)
class Marker:
    entry: str
    last_slot: float
    definition_json: str | None


@dataclass(frozen=True)
class Run:
    entry: str
    slot: float
    state: str
    task_id: str
    owner: str | None
    claimed_at: float
    sent_at: float | None


@dataclass(frozen=True)
class ClaimResult:
    """``claimed``: slots this call inserted; ``existing``: rows already there; ``marker``."""

    claimed: tuple[float, ...]
    existing: tuple[Run, ...]
    marker: float


@dataclass(frozen=True)
class Start:
    """What :meth:`ScheduleStore.start` decided for one delivery of a slot.

    ``started``: run the body (this delivery now owns the slot's start). Otherwise ``previous``
    is the row that refused it (``started`` by someone else, or ``skipped``). ``taken_over``:
    started in place of a previous start (``previous`` names it). ``recorded``: the slot had
    no row (pruned, or sent by something else than the scheduler); one was inserted.
    """

    started: bool
    previous: Run | None = None
    taken_over: bool = False
    recorded: bool = False


def _chunks(items: Sequence[Any], size: int = CHUNK) -> Iterable[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


class ScheduleStore:
    """Durable slot records for the beat scheduler, on a store's plumbing (:mod:`.db`)."""

    def __init__(self, store: Database) -> None:
        self.store = store
        self.runs = store.t.schedule_runs
        self.markers_t = store.t.schedule_markers

    # -- markers --------------------------------------------------------------------------

    @guarded
    def markers(self, prefix: str = "") -> dict[str, Marker]:
        """Every marker whose entry key starts with ``prefix``."""
        m = self.markers_t
        q = select(m.c.entry, m.c.last_slot, m.c.definition_json)
        if prefix:
            q = q.where(m.c.entry.startswith(prefix, autoescape=True))
        with self.store.reading() as conn:
            rows = conn.execute(q).all()
        return {r.entry: Marker(r.entry, float(r.last_slot), r.definition_json) for r in rows}

    @guarded
    def marker(self, entry: str) -> Marker | None:
        m = self.markers_t
        with self.store.reading() as conn:
            r = conn.execute(select(m.c.entry, m.c.last_slot, m.c.definition_json)
                             .where(m.c.entry == entry)).first()
        return None if r is None else Marker(r.entry, float(r.last_slot), r.definition_json)

    @guarded
    def ensure_markers(self, rows: Sequence[tuple[str, float, str | None]]) -> None:
        """Create missing markers ``(entry, last_slot, definition_json)``; keep existing ones."""
        if not rows:
            return
        m = self.markers_t
        now = self.store.now()
        with self.store.begin() as conn:
            for chunk in _chunks(rows):
                conn.execute(self.store.dialect.insert(m).values([
                    {"entry": e, "last_slot": s, "definition_json": d, "updated_at": now}
                    for e, s, d in chunk
                ]).on_conflict_do_nothing(index_elements=[m.c.entry]))

    @guarded
    def set_definitions(self, rows: Sequence[tuple[str, str]]) -> None:
        """Record the current definition of entries ``(entry, definition_json)``."""
        m = self.markers_t
        with self.store.begin() as conn:
            for entry, definition in rows:
                conn.execute(update(m).where(m.c.entry == entry)
                             .values(definition_json=definition))

    @guarded
    def advance(self, entry: str, last_slot: float) -> float:
        """Move the marker forward to ``last_slot`` (never back); return the marker."""
        with self.store.begin() as conn:
            return self._advance(conn, entry, last_slot, None)

    def _advance(self, conn: Connection, entry: str, last_slot: float,
                 definition_json: str | None) -> float:
        m = self.markers_t
        now = self.store.dialect.now()
        ins = self.store.dialect.insert(m).values(
            entry=entry, last_slot=last_slot, definition_json=definition_json, updated_at=now)
        later = case((ins.excluded.last_slot > m.c.last_slot, ins.excluded.last_slot),
                     else_=m.c.last_slot)
        set_: dict[str, Any] = {"last_slot": later, "updated_at": ins.excluded.updated_at}
        if definition_json is not None:
            set_["definition_json"] = ins.excluded.definition_json
        stmt = ins.on_conflict_do_update(index_elements=[m.c.entry], set_=set_)
        conn.execute(stmt)
        return float(conn.execute(select(m.c.last_slot).where(m.c.entry == entry)).scalar_one())

    @guarded
    def forget(self, entry: str) -> None:
        """Drop an entry that no longer exists (its slot history stays until pruned)."""
        with self.store.begin() as conn:
            conn.execute(delete(self.markers_t).where(self.markers_t.c.entry == entry))

    # -- slots ----------------------------------------------------------------------------

    @guarded
    def claim(self, entry: str, owner: str, send: Sequence[tuple[float, str]],
              skipped: Sequence[tuple[float, str]], *, marker: float,
              definition_json: str | None = None) -> ClaimResult:
        """Claim slots to send and record skipped ones, moving the marker, in one transaction.

        ``send`` and ``skipped`` are ``(slot, task_id)``. A slot that already has a row is not
        claimed again; its row is returned in ``existing`` for the caller to judge.

        Set-based, whatever the number of slots: on PostgreSQL one ``INSERT ... SELECT FROM
        unnest(slots, task_ids) ON CONFLICT DO NOTHING RETURNING slot`` per state; on SQLite
        (one writer at a time: ``BEGIN IMMEDIATE``) one read of the slots already recorded in
        the range, then one executemany of a single cached INSERT.
        """
        r = self.runs
        with self.store.begin() as conn:
            if self.store.dialect.is_sqlite:
                claimed, taken = self._claim_sqlite(conn, entry, owner, send, skipped)
            elif self.store.dialect.is_mysql:
                claimed, taken = self._claim_each(conn, entry, owner, send, skipped)
            else:
                claimed = self._insert_unnest(conn, entry, owner, CLAIMED, send)
                self._insert_unnest(conn, entry, owner, SKIPPED, skipped)
                got = set(claimed)
                taken = [s for s, _ in send if s not in got]
            existing: list[Run] = []
            for chunk in _chunks(taken):
                existing.extend(_run(x) for x in conn.execute(select(r).where(
                    r.c.entry == entry, r.c.slot.in_(list(chunk)))).all())
            current = self._advance(conn, entry, marker, definition_json)
        existing.sort(key=lambda run: run.slot)
        return ClaimResult(tuple(sorted(claimed)), tuple(existing), current)

    def _claim_sqlite(self, conn: Connection, entry: str, owner: str,
                      send: Sequence[tuple[float, str]],
                      skipped: Sequence[tuple[float, str]]) -> tuple[list[float], list[float]]:
        """SQLite: ``(claimed, already recorded)`` slots of ``send``; writes under the lock."""
        r = self.runs
        d = self.store.dialect
        before: set[float] = set()
        if send:
            lo = min(s for s, _ in send)
            hi = max(s for s, _ in send)
            before = {float(x) for x in conn.execute(select(r.c.slot).where(
                r.c.entry == entry, r.c.slot >= lo, r.c.slot <= hi)).scalars()}
        stmt = d.insert(r).values(entry=entry, state=bindparam("state"), owner=owner,
                                  claimed_at=d.now()).on_conflict_do_nothing(
            index_elements=[r.c.entry, r.c.slot])
        claimed = [s for s, _ in send if s not in before]
        params = [{"slot": s, "task_id": t, "state": CLAIMED} for s, t in send
                  if s not in before]
        params.extend({"slot": s, "task_id": t, "state": SKIPPED} for s, t in skipped)
        if params:  # executemany of one cached statement
            conn.execute(stmt, params)
        return claimed, sorted(s for s, _ in send if s in before)

    def _claim_each(self, conn: Connection, entry: str, owner: str,
                    send: Sequence[tuple[float, str]],
                    skipped: Sequence[tuple[float, str]]) -> tuple[list[float], list[float]]:
        """MySQL: ``(claimed, already recorded)`` slots of ``send``, one INSERT per slot.

        Neither a set-based insert that reports which rows it inserted (no ``RETURNING``;
        ``ON DUPLICATE KEY`` counts a no-op duplicate as a row under ``CLIENT_FOUND_ROWS``)
        nor SQLite's single writer: each slot's own INSERT, refused by its primary key when
        another beat recorded it first, is the claim. A catch-up of N windows costs N round
        trips, in one transaction."""
        r = self.runs
        d = self.store.dialect
        stmt = d.insert(r).values(entry=entry, slot=bindparam("slot"), state=bindparam("state"),
                                  task_id=bindparam("task_id"), owner=owner,
                                  claimed_at=d.now()).on_conflict_do_nothing()
        claimed: list[float] = []
        taken: list[float] = []
        for state, rows in ((CLAIMED, send), (SKIPPED, skipped)):
            for slot, task_id in rows:
                new = d.insert_if_absent(conn, stmt, {"slot": slot, "state": state,
                                                      "task_id": task_id})
                if state == CLAIMED:
                    (claimed if new else taken).append(slot)
        return claimed, sorted(taken)

    def _insert_unnest(self, conn: Connection, entry: str, owner: str, state: str,
                       rows: Sequence[tuple[float, str]]) -> list[float]:
        """PostgreSQL: insert ``(slot, task_id)`` rows missing; return the slots inserted."""
        if not rows:
            return []
        r = self.runs
        u = _unnest("slots", "ids")
        src = select(
            literal(entry, String).label("entry"), u.c.slot,
            literal(state, String).label("state"), u.c.task_id,
            literal(owner, String).label("owner"), self.store.dialect.now().label("claimed_at"),
        )
        stmt = (self.store.dialect.insert(r).from_select(list(_COLUMNS), src)
                .on_conflict_do_nothing(index_elements=[r.c.entry, r.c.slot])
                .returning(r.c.slot))
        res = conn.execute(stmt, {"slots": [s for s, _ in rows], "ids": [t for _, t in rows]})
        return [float(x) for x in res.scalars()]

    @guarded
    def mark_sent(self, entry: str, slots: Sequence[float], owner: str) -> int:
        """Record slots as sent (only rows this owner still holds), in one transaction.

        A slot a worker already ``started`` (it can start before the send is recorded) keeps
        its state and gets its send time; it counts as sent. One UPDATE per chunk of sorted
        slots (``slot = ANY(:slots)`` on PostgreSQL, an ``IN`` list on SQLite), bounded by the
        chunk's first and last slot, and with the state test written as a CASE: the only
        index it can use is the primary key's (entry, slot range). A plain ``state =
        'claimed'`` test lets a plan made on stale statistics scan every claimed row of the
        table per chunk, quadratic in a large catch-up.
        """
        if not slots:
            return 0
        r = self.runs
        sqlite = self.store.dialect.is_sqlite
        listed = (r.c.slot == any_(bindparam("b_slots", type_=ARRAY(Float)))
                  if self.store.dialect.name == "postgresql"
                  else r.c.slot.in_(bindparam("b_slots", expanding=True)))
        stmt = update(r).where(
            r.c.entry == entry, r.c.slot >= bindparam("b_lo"), r.c.slot <= bindparam("b_hi"),
            listed,
            case((r.c.state == CLAIMED, r.c.owner == owner),
                 (r.c.state == STARTED, r.c.sent_at.is_(None)), else_=false()),
        ).values(state=case((r.c.state == CLAIMED, SENT), else_=r.c.state),
                 sent_at=self.store.dialect.now())
        n = 0
        with self.store.begin() as conn:
            for chunk in _chunks(sorted(slots), CHUNK if sqlite else SEND_CHUNK):
                n += conn.execute(stmt, {"b_slots": list(chunk), "b_lo": chunk[0],
                                         "b_hi": chunk[-1]}).rowcount
        return n

    @guarded
    def start(self, entry: str, slot: float, task_id: str, starter: str, *,
              take_over: Callable[[Run], bool] | None = None) -> Start:
        """Record that ``starter`` starts the slot's task; at most one start per slot.

        One transaction: a ``claimed`` or ``sent`` row becomes ``started`` with ``starter`` as
        its owner. A slot without a row gets one, ``started``. A row already ``started`` is
        refused, unless ``take_over(row)`` says its start is to be replaced (compare-and-set on
        its owner, so of two deliveries that both may take over, one does). A ``skipped``
        row is refused.
        """
        r = self.runs
        d = self.store.dialect
        this = and_(r.c.entry == entry, r.c.slot == slot)
        with self.store.begin() as conn:
            if conn.execute(update(r).where(this, r.c.state.in_((CLAIMED, SENT)))
                            .values(state=STARTED, owner=starter)).rowcount == 1:
                return Start(True)
            # Not rowcount: psycopg reports -1 here
            if d.insert_if_absent(conn, d.insert(r).values(
                    entry=entry, slot=slot, state=STARTED, task_id=task_id, owner=starter,
                    claimed_at=d.now()).on_conflict_do_nothing(
                        index_elements=[r.c.entry, r.c.slot])):
                return Start(True, recorded=True)
            row = conn.execute(select(r).where(this)).first()
            if row is None:  # deleted meanwhile (pruned): nothing to hold, nothing to refuse
                return Start(False)
            previous = _run(row)
            if previous.state != STARTED or take_over is None or not take_over(previous):
                return Start(False, previous)
            owner = r.c.owner.is_(None) if previous.owner is None else r.c.owner == previous.owner
            won = conn.execute(update(r).where(this, r.c.state == STARTED, owner)
                               .values(owner=starter)).rowcount == 1
            return Start(won, previous, taken_over=won)

    @guarded
    def take_over(self, entry: str, slot: float, previous_owner: str | None,
                  owner: str) -> bool:
        """Compare-and-set a ``claimed`` row to a new owner; False if someone else moved it."""
        r = self.runs
        cond = [r.c.entry == entry, r.c.slot == slot, r.c.state == CLAIMED]
        cond.append(r.c.owner.is_(None) if previous_owner is None
                    else r.c.owner == previous_owner)
        with self.store.begin() as conn:
            res = conn.execute(update(r).where(and_(*cond)).values(
                owner=owner, claimed_at=self.store.dialect.now()))
        return bool(res.rowcount == 1)

    @guarded
    def take_over_many(self, entry: str, rows: Sequence[tuple[float, str | None]],
                       owner: str) -> list[float]:
        """:meth:`take_over` of many ``(slot, previous_owner)`` rows of one entry, in one
        transaction (one compare-and-set statement per previous owner and :data:`CHUNK`
        slots); return the slots taken."""
        r = self.runs
        by_owner: dict[str | None, list[float]] = {}
        for slot, previous in rows:
            by_owner.setdefault(previous, []).append(slot)
        won: list[float] = []
        with self.store.begin() as conn:
            now = self.store.dialect.now()
            for previous, slots in by_owner.items():
                was = r.c.owner.is_(None) if previous is None else r.c.owner == previous
                which = and_(r.c.entry == entry, r.c.state == CLAIMED, was,
                             r.c.slot.in_(bindparam("slots", expanding=True)))
                stmt = update(r).where(which).values(owner=owner, claimed_at=now)
                for chunk in _chunks(slots):
                    if self.store.dialect.is_mysql:
                        # no UPDATE ... RETURNING: lock the rows that match, then move them
                        mine = [float(x) for x in conn.execute(
                            select(r.c.slot).where(which).with_for_update(),
                            {"slots": list(chunk)}).scalars()]
                        conn.execute(update(r).where(r.c.entry == entry, r.c.slot.in_(mine))
                                     .values(owner=owner, claimed_at=now))
                        won.extend(mine)
                        continue
                    won.extend(float(x) for x in conn.execute(
                        stmt.returning(r.c.slot), {"slots": list(chunk)}).scalars())
        return sorted(won)

    @guarded
    def pending(self, prefix: str = "", limit: int = 1000) -> list[Run]:
        """Claimed slots not yet recorded as sent, oldest first, with the database's now."""
        r = self.runs
        q = select(r).where(r.c.state == CLAIMED).order_by(r.c.claimed_at, r.c.slot).limit(limit)
        if prefix:
            q = q.where(r.c.entry.startswith(prefix, autoescape=True))
        with self.store.reading() as conn:
            rows = conn.execute(q).all()
        return [_run(x) for x in rows]

    @guarded
    def runs_of(self, entry: str) -> list[Run]:
        """Every recorded slot of an entry, oldest first (for operators and tests)."""
        r = self.runs
        with self.store.reading() as conn:
            rows = conn.execute(select(r).where(r.c.entry == entry).order_by(r.c.slot)).all()
        return [_run(x) for x in rows]

    @guarded
    def get_runs(self, keys: Sequence[tuple[str, float]]) -> list[Run]:
        r = self.runs
        out: list[Run] = []
        with self.store.reading() as conn:
            for chunk in _chunks(keys):
                out.extend(_run(x) for x in conn.execute(
                    select(r).where(tuple_(r.c.entry, r.c.slot).in_(list(chunk)))).all())
        return out

    @guarded
    def prune(self, older_than: float) -> int:
        """Delete sent, started and skipped slot rows claimed more than ``older_than`` seconds
        ago, in batches (short transactions, an index on ``claimed_at``)."""
        cutoff = self.store.now() - older_than
        total = 0
        while True:
            deleted = retention.delete_beat_runs(self.store, cutoff)
            total += deleted
            if deleted < retention.PRUNE_BATCH:
                return total


def _unnest(slots: str, ids: str) -> Any:
    """PostgreSQL: ``unnest(:slots, :ids) AS u(slot, task_id)``, two array parameters."""
    return (func.unnest(bindparam(slots, type_=ARRAY(Float)), bindparam(ids, type_=ARRAY(String)))
            .table_valued("slot", "task_id").render_derived(name="u"))


def _run(row: Any) -> Run:
    return Run(row.entry, float(row.slot), row.state, row.task_id, row.owner,
               float(row.claimed_at), None if row.sent_at is None else float(row.sent_at))
