"""ScheduleStore contract on SQLite and PostgreSQL: claims are exclusive, markers only advance."""

from __future__ import annotations

import threading

from celery_resilient.beat.windows import from_seconds, to_seconds
from celery_resilient.store.schedule import CLAIMED, SENT, SKIPPED, STARTED, Run, ScheduleStore
from celery_resilient.store.sql import Store

T0 = 1_750_000_000_123_456  # microseconds: slots keep their microseconds exactly


def _slots(n: int, start: int = T0, step: int = 2_000_000) -> list[float]:
    return [to_seconds(start + k * step) for k in range(1, n + 1)]


def test_claim_inserts_rows_and_moves_marker(store: Store) -> None:
    s = ScheduleStore(store)
    slots = _slots(3)
    res = s.claim("e", "beat-a", [(x, f"t{i}") for i, x in enumerate(slots[1:])],
                  [(slots[0], "t-skip")], marker=slots[-1], definition_json='{"d": 1}')
    assert sorted(res.claimed) == slots[1:]
    assert res.existing == ()
    assert res.marker == slots[-1]
    rows = s.runs_of("e")
    assert [(r.slot, r.state) for r in rows] == [(slots[0], SKIPPED), (slots[1], CLAIMED),
                                                 (slots[2], CLAIMED)]
    assert from_seconds(rows[2].slot) == T0 + 3 * 2_000_000
    marker = s.marker("e")
    assert marker is not None and marker.definition_json == '{"d": 1}'


def test_second_claim_of_a_slot_gets_the_existing_row(store: Store) -> None:
    s = ScheduleStore(store)
    slot = _slots(1)[0]
    assert s.claim("e", "a", [(slot, "t")], [], marker=slot).claimed == (slot,)
    again = s.claim("e", "b", [(slot, "t")], [], marker=slot)
    assert again.claimed == ()
    assert [(r.owner, r.state) for r in again.existing] == [("a", CLAIMED)]
    assert s.mark_sent("e", [slot], "b") == 0, "only the owner records the send"
    assert s.mark_sent("e", [slot], "a") == 1
    assert s.claim("e", "b", [(slot, "t")], [], marker=slot).existing[0].state == SENT


def test_marker_never_moves_back(store: Store) -> None:
    s = ScheduleStore(store)
    late, early = _slots(5)[4], _slots(5)[0]
    assert s.advance("e", late) == late
    assert s.advance("e", early) == late
    assert s.claim("e", "a", [(early, "t")], [], marker=early).marker == late


def test_take_over_is_compare_and_set(store: Store) -> None:
    s = ScheduleStore(store)
    slot = _slots(1)[0]
    s.claim("e", "dead", [(slot, "t")], [], marker=slot)
    assert s.take_over("e", slot, "dead", "b") is True
    assert s.take_over("e", slot, "dead", "c") is False, "the first taker wins"
    assert [r.owner for r in s.pending()] == ["b"]
    s.mark_sent("e", [slot], "b")
    assert s.pending() == []


def test_concurrent_claims_have_exactly_one_winner_per_slot(store: Store) -> None:
    s = ScheduleStore(store)
    slots = _slots(200)
    won: dict[str, list[float]] = {}
    barrier = threading.Barrier(4)

    def claimer(owner: str) -> None:
        barrier.wait()
        mine: list[float] = []
        for chunk in range(0, len(slots), 20):
            part = slots[chunk:chunk + 20]
            mine.extend(s.claim("e", owner, [(x, "t") for x in part], [],
                                marker=part[-1]).claimed)
        won[owner] = mine

    threads = [threading.Thread(target=claimer, args=(f"beat-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    claimed = [x for xs in won.values() for x in xs]
    assert sorted(claimed) == slots, "every slot claimed exactly once across four beats"


def test_markers_by_prefix_forget_and_prune(store: Store) -> None:
    s = ScheduleStore(store)
    s.ensure_markers([("a:x", 1.0, None), ("a:y", 2.0, '{"v": 1}'), ("b:z", 3.0, None)])
    s.ensure_markers([("a:x", 99.0, None)])  # existing markers are kept
    assert {k: m.last_slot for k, m in s.markers("a:").items()} == {"a:x": 1.0, "a:y": 2.0}
    s.set_definitions([("a:x", '{"v": 2}')])
    assert s.marker("a:x") is not None and s.marker("a:x").definition_json == '{"v": 2}'  # type: ignore[union-attr]
    s.forget("a:x")
    assert s.marker("a:x") is None
    slot = _slots(1)[0]
    s.claim("a:y", "o", [(slot, "t")], [(slot + 2, "u")], marker=slot + 2)
    s.mark_sent("a:y", [slot], "o")
    assert s.prune(older_than=3600) == 0
    assert s.prune(older_than=-10) == 2
    assert s.runs_of("a:y") == []


def test_large_claim_is_one_transaction(store: Store) -> None:
    s = ScheduleStore(store)
    slots = _slots(2500, step=1_000_000)
    res = s.claim("big", "o", [(x, f"t{i}") for i, x in enumerate(slots)], [], marker=slots[-1])
    assert len(res.claimed) == 2500
    assert s.mark_sent("big", slots, "o") == 2500
    assert s.pending() == []


# -- one start per slot (the worker's check for plain tasks, celery_resilient.beat.once) ------


def test_start_once_per_slot_from_claimed_or_sent(store: Store) -> None:
    """The first delivery starts the slot, whether or not beat recorded the send; a second
    delivery of the same slot (a beat re-send after a crash) is refused; beat no longer
    re-sends a started slot, and its late record of the send still counts it."""
    s = ScheduleStore(store)
    unrecorded, recorded = _slots(2)
    s.claim("e", "beat-1", [(unrecorded, "t1"), (recorded, "t2")], [], marker=recorded)
    assert s.mark_sent("e", [recorded], "beat-1") == 1
    for slot, task_id in ((unrecorded, "t1"), (recorded, "t2")):
        first = s.start("e", slot, task_id, "worker-a")
        assert first.started and not first.taken_over and not first.recorded
        again = s.start("e", slot, task_id, "worker-b")
        assert not again.started
        assert again.previous is not None
        assert (again.previous.state, again.previous.owner) == (STARTED, "worker-a")
    assert s.pending() == [], "a started slot is never re-sent"
    assert s.mark_sent("e", [unrecorded], "beat-1") == 1, "the late record counts the send"
    rows = {r.slot: r for r in s.runs_of("e")}
    assert rows[unrecorded].state == STARTED and rows[unrecorded].sent_at is not None
    assert rows[recorded].state == STARTED
    assert s.claim("e", "beat-2", [(unrecorded, "t1")], [], marker=recorded).claimed == ()
    assert s.prune(older_than=-10) == 2, "started rows are pruned like sent ones"


def test_start_of_an_unknown_slot_records_it_and_a_skipped_slot_is_refused(
        store: Store) -> None:
    s = ScheduleStore(store)
    pruned, skipped = _slots(2)
    s.claim("e", "beat", [], [(skipped, "t-skip")], marker=skipped)
    first = s.start("e", pruned, "t", "worker-a")
    assert first.started and first.recorded
    assert not s.start("e", pruned, "t", "worker-b").started
    refused = s.start("e", skipped, "t-skip", "worker-a", take_over=lambda row: True)
    assert not refused.started and refused.previous is not None
    assert refused.previous.state == SKIPPED


def test_start_take_over_is_compare_and_set(store: Store) -> None:
    """A start may be replaced only when the caller's predicate says so (acks_late: the
    starter is gone or the message was redelivered), and only by one delivery."""
    s = ScheduleStore(store)
    slot = _slots(1)[0]
    s.claim("e", "beat", [(slot, "t")], [], marker=slot)
    assert s.start("e", slot, "t", "dead-worker").started
    seen: list[Run] = []

    def gone(row: Run) -> bool:
        seen.append(row)
        return row.owner == "dead-worker"

    assert not s.start("e", slot, "t", "worker-b", take_over=lambda row: False).started
    won = s.start("e", slot, "t", "worker-b", take_over=gone)
    assert won.started and won.taken_over
    assert won.previous is not None and won.previous.owner == "dead-worker"
    lost = s.start("e", slot, "t", "worker-c", take_over=gone)
    assert not lost.started, "the previous owner changed: the second taker loses"
    assert [r.owner for r in seen] == ["dead-worker", "worker-b"]
    assert [r.owner for r in s.runs_of("e")] == ["worker-b"]


def test_concurrent_starts_of_a_slot_have_exactly_one_winner(store: Store) -> None:
    s = ScheduleStore(store)
    slots = _slots(30)
    s.claim("e", "beat", [(x, "t") for x in slots], [], marker=slots[-1])
    s.mark_sent("e", slots[::2], "beat")  # half recorded sent, half left claimed
    won: dict[str, list[float]] = {}
    barrier = threading.Barrier(4)

    def worker(owner: str) -> None:
        barrier.wait()
        won[owner] = [x for x in slots if s.start("e", x, "t", owner).started]

    threads = [threading.Thread(target=worker, args=(f"w-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    started = sorted(x for xs in won.values() for x in xs)
    assert started == slots, "every slot started exactly once across four workers"
    assert {r.state for r in s.runs_of("e")} == {STARTED}
