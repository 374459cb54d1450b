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


def test_only_progress_resets_the_republish_count(store: Store) -> None:
    """A message that is taken, makes no progress and comes back (a retry with another work
    key left its old key behind, a body that always hands back) stops at the cap."""
    key = "loop"
    store.record_submission(key, "proj.task", "tid-loop", None, '{"m": 1}', 10)
    sweeper = owner("s@host")
    for n in range(1, 4):
        expire(store, key)
        assert [o.work_key for o in store.claim_orphans(sweeper, 10, 10, max_republish=3)] == [
            key]
        claim = run(store, key, owner(f"w{n}@host"), task_id="tid-loop")
        store.release(key, claim.epoch, 10)  # handed back without progress
        row = store.get_work(key)
        assert row is not None and row.republished == n, "a take is not progress"
    expire(store, key)
    assert store.claim_orphans(sweeper, 10, 10, max_republish=3) == []
    assert store.get_work(key).state == "dead"  # type: ignore[union-attr]

    store.record_submission("moving", "proj.task", "tid-moving", None, '{"m": 1}', 10)
    for n in range(1, 6):
        expire(store, "moving")
        assert store.claim_orphans(sweeper, 10, 10, max_republish=3)
        claim = run(store, "moving", owner(f"m{n}@host"), task_id="tid-moving")
        store.save_checkpoint("moving", claim.epoch, f'{{"row": {n}}}')
        store.release("moving", claim.epoch, 10)
        assert store.get_work("moving").republished == 0  # type: ignore[union-attr]


def test_stale_copies_of_an_earlier_try_never_run(store: Store) -> None:
    """After a retry's hand-back, a copy of the try before it (re-published and also
    redelivered) is refused; the retried message itself takes the claim."""
    first = run(store, "try", owner("a@host"), task_id="t-try")
    store.release("try", first.epoch, 30, next_retries=1)
    stale = store.take("try", "proj.task", "t-try", None, owner("b@host"), 30, 5,
                       never_live, retries=0)
    assert stale.action == "duplicate" and "stale copy of try 0" in stale.reason
    retried = store.take("try", "proj.task", "t-try", None, owner("b@host"), 30, 5,
                         never_live, retries=1)
    assert retried.action == "run"
    late = store.take("try", "proj.task", "t-try", None, owner("c@host"), 30, 5,
                      never_live, retries=0)
    assert late.action in ("duplicate", "held")
    assert store.get_work("try").epoch == first.epoch + 1  # type: ignore[union-attr]


def test_a_finish_retried_after_its_commit_landed_succeeds(store: Store) -> None:
    """The finish committed but its reply was lost (the connection dropped): the store layer
    runs it again on a fresh connection. It must succeed, or the task is reported IGNORED
    and its callbacks never fire; any other writer is still refused."""
    from celery_resilient.errors import StaleClaimError

    claim = run(store, "fin", owner("a@host"))
    store.finish("fin", claim.epoch, '"r"')
    store.finish("fin", claim.epoch, '"r"')  # the retried statement of the same finish
    try:
        store.finish("fin", claim.epoch, '"other"')
    except StaleClaimError:
        pass
    else:
        raise AssertionError("a different result over a done claim was accepted")
    row = store.get_work("fin")
    assert row is not None and (row.state, row.result_json) == ("done", '"r"')
