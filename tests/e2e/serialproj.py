"""The Celery app of the serializer e2e tests: resumable work whose arguments JSON cannot carry.

Configured by environment: RESILIENT_BROKER, RESILIENT_STORE_URL, RESILIENT_TABLE_PREFIX,
RESILIENT_QUEUE, RESILIENT_EFFECT_LOG, RESILIENT_RESULT_BACKEND (default: the broker when it is
Redis, else Redis DB 9), optional RESILIENT_EXTRA (JSON of extra app.conf settings), and

``RESILIENT_SERIALIZER``
    ``pickle`` (default), ``yaml``, ``msgpack`` or ``json``: the app's ``task_serializer``;
    ``accept_content`` is that serializer and ``json``. Results use ``pickle`` in a pickle
    app, else ``json`` (kombu's JSON, which keeps datetimes and Decimals).
``RESILIENT_DROP_RECEIPTS=1``
    every receipt flush of the worker's main process fails, so the pool's take always
    beats its receipt and the only stored message is the one the take built.

``create_app`` also builds the same app inside a test process (the client sends with the
app's serializer). ``payload(serializer)`` is the argument each serializer is tested with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from celery import Celery, signals

from celery_resilient import Resilient, ResumableTask
from celery_resilient.testing import EffectLog

from .envapp import app_from_env
from .lifecycleproj import result_backend_for

NAME = "tests.e2e.serialproj"
SINCE = datetime(2024, 2, 29, 12, 30, tzinfo=timezone.utc)


class Token:
    """A plain class instance: pickle carries it, JSON, YAML (safe) and msgpack do not."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Token) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"Token({self.name!r})"


def payload(serializer: str) -> dict[str, Any]:
    """Arguments JSON cannot carry, as far as ``serializer`` can carry them."""
    if serializer == "pickle":
        return {"tags": {3, 1, 2}, "since": SINCE, "token": Token("alpha"), "raw": b"\x00\xff",
                "pair": (1, "one")}
    if serializer == "yaml":  # yaml.safe_dump: sets, bytes and datetimes, no classes
        return {"tags": {3, 1, 2}, "since": SINCE, "raw": b"\x00\xff"}
    if serializer == "msgpack":  # bytes only
        return {"raw": b"\x00\xff", "more": b"\x01"}
    return {"tags": [1, 2, 3], "since": SINCE}


def describe(value: Any) -> Any:
    """``value`` in JSON, every type named: what a run saw, for the effect log and the result."""
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in sorted(value.items())}
    if isinstance(value, (set, frozenset)):
        return {"set": sorted(describe(v) for v in value)}
    if isinstance(value, tuple):
        return {"tuple": [describe(v) for v in value]}
    if isinstance(value, list):
        return [describe(v) for v in value]
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, datetime):
        return {"datetime": value.isoformat()}
    if isinstance(value, Token):
        return {"Token": value.name}
    return value


def create_app(env: Mapping[str, str]) -> Celery:
    serializer = env.get("RESILIENT_SERIALIZER", "pickle")
    app = app_from_env("serialproj", env, backend=result_backend_for(env))
    app.conf.update(task_serializer=serializer,
                    result_serializer="pickle" if serializer == "pickle" else "json",
                    accept_content=sorted({serializer, "json"}),
                    result_accept_content=sorted({serializer, "json", "pickle"}))
    effects = EffectLog(env.get("RESILIENT_EFFECT_LOG", os.devnull))

    if env.get("RESILIENT_DROP_RECEIPTS"):
        @signals.worker_init.connect(weak=False)
        def drop_receipts(sender: Any = None, **_: Any) -> None:
            store = Resilient.of(app).store

            def refuse(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("receipt write refused (RESILIENT_DROP_RECEIPTS)")

            store.record_receipts = refuse  # type: ignore[method-assign]

    def charge(task_id: str) -> str:
        effects.record(f"charge:{task_id}")
        return f"receipt-{task_id}"

    @app.task(base=ResumableTask, bind=True, shared=False, name=f"{NAME}.crunch")
    def crunch(self: ResumableTask, data: dict[str, Any], rows: int,
               delay: float) -> dict[str, Any]:
        """Checkpoints after every row, then one ledger effect; returns a Decimal and what
        it saw of its arguments (the resumed run must see the very same types)."""
        state = self.checkpoint.load(default={"row": 0})
        seen = describe(data)
        task_id = self.request.id
        effects.record(f"start:{task_id}", row=state["row"], epoch=self.fencing_token,
                       seen=seen)
        for i in range(state["row"], rows):
            time.sleep(delay)
            effects.record(f"row:{task_id}:{i}", epoch=self.fencing_token)
            self.checkpoint.save({"row": i + 1})
        charged = self.ledger.once(f"charge:{task_id}", charge, task_id)
        return {"rows": rows, "resumed_from": state["row"], "seen": seen, "charge": charged,
                "total": Decimal(rows) / 4}

    return app


app = create_app(os.environ)
