"""The Celery app of the transient-error e2e test: a ``ledger.atomic`` block that loses a real
serialization failure on its first execution.

Configured by environment: RESILIENT_BROKER, RESILIENT_STORE_URL (the test gives connections
that run SERIALIZABLE), RESILIENT_TABLE_PREFIX, RESILIENT_QUEUE, RESILIENT_EFFECT_LOG,
RESILIENT_RESULT_BACKEND (default Redis DB 9) and optional RESILIENT_EXTRA (JSON of extra
app.conf settings).

``book`` takes a seat in the user's own tables (``<prefix>seats``, ``<prefix>bookings``) inside
``self.ledger.atomic()``. On its first execution another client takes a seat and commits
between the block's read and its write, so the block's UPDATE fails with SQLSTATE 40001. Every
run records ``run:<task id>`` in the effect log, the provoked conflict ``conflict:<task id>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from celery import Celery
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, select, update

from celery_resilient import ResumableTask
from celery_resilient.testing import EffectLog

from .envapp import app_from_env

NAME = "tests.e2e.transientproj"
SEATS = 10


def tables(prefix: str) -> tuple[Table, Table]:
    """The user's own tables in the store's database: ``(seats, bookings)``."""
    metadata = MetaData()
    seats = Table(f"{prefix}seats", metadata, Column("id", Integer, primary_key=True),
                  Column("free", Integer, nullable=False))
    bookings = Table(f"{prefix}bookings", metadata,
                     Column("id", Integer, primary_key=True, autoincrement=True),
                     Column("work_key", String(255), nullable=False),
                     Column("seat", Integer, nullable=False))
    return seats, bookings


def create_app(env: Mapping[str, str]) -> Celery:
    app = app_from_env("transientproj", env, backend=env.get(
        "RESILIENT_RESULT_BACKEND", "redis://127.0.0.1:6379/9"))
    effects = EffectLog(env.get("RESILIENT_EFFECT_LOG", os.devnull))
    seats, bookings = tables(env.get("RESILIENT_TABLE_PREFIX", "resilient_"))

    def take_a_seat_concurrently() -> None:
        """Another client of the same database (read committed) takes a seat and commits."""
        other = create_engine(env["RESILIENT_STORE_URL"].split("?", 1)[0])
        try:
            with other.begin() as conn:
                conn.execute(update(seats).where(seats.c.id == 1).values(free=seats.c.free - 1))
        finally:
            other.dispose()

    @app.task(base=ResumableTask, bind=True, shared=False, name=f"{NAME}.book")
    def book(self: ResumableTask) -> str:
        effects.record(f"run:{self.request.id}", epoch=self.fencing_token, attempt=self.attempt)
        with self.ledger.atomic() as tx:
            if not tx.applied:
                free = tx.execute(select(seats.c.free).where(seats.c.id == 1)).scalar_one()
                if effects.count(f"conflict:{self.request.id}") == 0:
                    take_a_seat_concurrently()
                    effects.record(f"conflict:{self.request.id}")
                tx.execute(update(seats).where(seats.c.id == 1).values(free=free - 1))
                tx.execute(bookings.insert().values(work_key=self.work_key, seat=SEATS - free))
        return f"booked {self.work_key}"

    return app


app = create_app(os.environ)
