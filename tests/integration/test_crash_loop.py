"""The crash-loop counter and bounded re-publishing, on SQLite and PostgreSQL.

Deaths count only when an owner really died; checkpoint progress since the last death resets
the count, so a long task interrupted by many deploys while advancing is not poison, while one
that dies again and again at the same checkpoint is. Re-publishing backs off and is capped.
"""

from __future__ import annotations

from celery_resilient.store.sql import Store

from .helpers import expire, never_live, owner, run, take


def _deaths(store: Store, key: str) -> int:
    row = store.get_work(key)
    assert row is not None
    return row.deaths


def test_progress_resets_deaths_and_no_progress_parks_the_work(store: Store) -> None:
    key = "long"
    epoch = run(store, key, owner("a@host")).epoch
    store.save_checkpoint(key, epoch, '{"row": 1}')
    for n in range(2, 7):  # five deploys, each after progress: never poison
        expire(store, key)  # the owner is gone: its lease ran out
        claim = run(store, key, owner(f"w{n}@host"), is_live=never_live, max_attempts=3)
        assert claim.deaths == 1, "the takeover counts the death of the earlier owner"
        store.save_checkpoint(key, claim.epoch, f'{{"row": {n}}}')
        assert _deaths(store, key) == 0, "a checkpoint that advanced resets the count"
    # Now it dies at the same checkpoint each time: the same state saved again is no progress.
    for n in (1, 2):
        expire(store, key)
        claim = run(store, key, owner(f"x{n}@host"), is_live=never_live, max_attempts=3)
        store.save_checkpoint(key, claim.epoch, '{"row": 6}')
        assert _deaths(store, key) == n
    expire(store, key)
    parked = take(store, key, owner("y@host"), is_live=never_live, max_attempts=3)
    assert parked.action == "dead" and "died 3 times" in parked.reason
    row = store.get_work(key)
    assert row is not None and row.state == "dead"


def test_a_retry_hand_back_is_not_a_death(store: Store) -> None:
    claim = run(store, "r", owner("a@host"))
    store.release("r", claim.epoch, 30)
    again = run(store, "r", owner("b@host"))
    assert again.deaths == 0 and again.epoch == claim.epoch + 1
    # A copy re-sent by the execution itself (supersedes its epoch) takes over without a death.
    over = run(store, "r", owner("c@host"), supersedes=again.epoch)
    assert over.deaths == 0


def test_republishing_backs_off_and_is_capped(store: Store) -> None:
    key = "never-taken"
    store.record_submission(key, "proj.task", "tid-never", None, '{"m": 1}', 10)
    sweeper = owner("sweeper@host")
    leases = []
    for n in range(3):
        expire(store, key)
        before = store.now()
        sent = store.claim_orphans(sweeper, 10, 10, max_republish=3, max_hold_seconds=35)
        assert [o.work_key for o in sent] == [key]
        row = store.get_work(key)
        assert row is not None and row.republished == n + 1
        assert row.lease_expires_at is not None
        leases.append(round(row.lease_expires_at - before))
    assert leases == [10, 20, 35], "hold doubles per re-publish, up to the maximum"
    expire(store, key)
    assert store.claim_orphans(sweeper, 10, 10, max_republish=3) == []
    row = store.get_work(key)
    assert row is not None and row.state == "dead"
    assert row.error is not None and "re-published 3 times" in row.error
    # Parked work is terminal: never re-published again.
    expire(store, key)
    assert store.claim_orphans(sweeper, 10, 10, max_republish=3) == []


def test_a_take_resets_the_republish_count(store: Store) -> None:
    key = "taken"
    store.record_submission(key, "proj.task", "tid-taken", None, '{"m": 1}', 10)
    expire(store, key)
    store.claim_orphans(owner("s@host"), 10, 10, max_republish=3)
    run(store, key, owner("w@host"), task_id="tid-taken")
    row = store.get_work(key)
    assert row is not None and row.republished == 0
