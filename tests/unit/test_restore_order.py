"""The order a gone worker's holding goes back in (``broker.holdings.restore_order``): the
queue's front must read as the messages were fetched, so the work the worker had started
(always fetched before what it had only prefetched) is what the next fetch takes first."""

from __future__ import annotations

import random

from celery_resilient.broker.holdings import Held, restore_order


def _held(tag: str, fetched_at: float | None) -> Held:
    return Held(tag, f"task-{tag}", "proj.task", fetched_at, True)


def _front_after(items: list[Held]) -> list[str]:
    """The queue's front after each item is pushed onto it in turn (kombu's restore: RPUSH
    onto a list consumers pop from the right), read from the front."""
    front: list[str] = []
    for item in restore_order(items):
        front.insert(0, item.tag)
    return front


def test_the_front_reads_in_fetch_order_whatever_the_tags() -> None:
    fetched = [_held(tag, 1000.0 + i * 0.001) for i, tag in enumerate(
        ["f3", "a9", "zz", "00", "m1", "b7"])]  # tags in no order of their own
    shuffled = fetched[:]
    random.Random(7).shuffle(shuffled)
    assert _front_after(shuffled) == [h.tag for h in fetched]


def test_started_work_comes_back_before_prefetched_work() -> None:
    """A worker with 4 slots ran the 4 first fetched and held 12 more: the 4 come first."""
    started = [_held(f"s{i}", 10.0 + i) for i in range(4)]
    prefetched = [_held(f"p{i}", 20.0 + i) for i in range(12)]
    front = _front_after([*prefetched, *started][::-1])
    assert front[:4] == ["s0", "s1", "s2", "s3"]
    assert front[4:] == [f"p{i}" for i in range(12)]


def test_unknown_fetch_times_go_behind_the_known_ones() -> None:
    items = [_held("late", None), _held("b", 2.0), _held("a", 1.0), _held("early", None)]
    assert _front_after(items) == ["a", "b", "early", "late"]


def test_one_clock_reading_reads_in_tag_order() -> None:
    assert _front_after([_held("y", 5.0), _held("x", 5.0), _held("w", 4.0)]) == ["w", "x", "y"]


def test_nothing_to_give_back() -> None:
    assert restore_order([]) == []
