"""The worker's maintainer thread: receipts batched, a bad batch never starves the heartbeat."""

from __future__ import annotations

import os

from celery import Celery

from celery_resilient import Resilient
from celery_resilient.core.identity import Owner
from celery_resilient.store.sql import Receipt
from celery_resilient.worker.maintainer import Maintainer


def _maintainer(pg_url: str, prefix: str) -> tuple[Maintainer, Resilient]:
    app = Celery("maint", set_as_current=False)
    app.conf.update(resilient_store_url=pg_url, resilient_table_prefix=prefix,
                    resilient_auto_migrate=True)
    rt = Resilient(app)
    return Maintainer(rt, Owner("maint@host", "inc-1", os.getpid())), rt


def test_receipts_flush_in_one_round_and_a_bad_batch_is_dropped(pg_url: str,
                                                                table_prefix: str) -> None:
    maint, rt = _maintainer(pg_url, table_prefix)
    try:
        for i in range(3):
            rt.unacked.add(f"t{i}")  # as the worker's record_received does
            rt.receipts.add(Receipt(f"k{i}", "maint.task", f"t{i}", None, '{"m": 1}'))
        assert maint.flush_receipts() == 3 and len(rt.receipts) == 0
        assert [rt.store.get_work(f"k{i}").state for i in range(3)] == ["reserved"] * 3  # type: ignore[union-attr]

        # Acked (or rejected) before its receipt was written: not this worker's any more.
        rt.unacked.add("t-gone")
        rt.receipts.add(Receipt("k-gone", "maint.task", "t-gone", None, '{"m": 1}'))
        rt.unacked.release("t-gone")
        assert maint.flush_receipts() == 0 and len(rt.receipts) == 0
        assert rt.store.get_work("k-gone") is None

        rt.unacked.add("t-bad")
        rt.receipts.add(Receipt("x" * 300, "maint.task", "t-bad", None, None))  # > 255 chars
        assert maint.flush_receipts() == 0, "an unwritable batch must be dropped, not retried"
        assert len(rt.receipts) == 0

        # One unwritable receipt among others costs only its own.
        for task_id, key in (("t-a", "k-a"), ("t-bad", "x" * 300), ("t-b", "k-b")):
            rt.unacked.add(task_id)
            rt.receipts.add(Receipt(key, "maint.task", task_id, None, '{"m": 1}'))
        assert maint.flush_receipts() == 2 and len(rt.receipts) == 0
        assert [rt.store.get_work(k).state for k in ("k-a", "k-b")] == ["reserved"] * 2  # type: ignore[union-attr]
        assert rt.store.heartbeat(maint.owner, 30) is True  # the lease is still renewed
    finally:
        rt.store.dispose()
