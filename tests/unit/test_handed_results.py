"""What a pool process remembers of the results it handed over (tasks/handed_results.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_resilient.tasks import handed_results


@pytest.fixture
def channel(monkeypatch: pytest.MonkeyPatch) -> Iterator[handed_results.Reader]:
    handed_results.open_channel()
    handed_results.accepting(True)
    monkeypatch.setattr(handed_results, "_handed", {})
    reader = handed_results.Reader()
    yield reader
    reader.drain()
    handed_results.accepting(False)


def test_a_result_handed_over_counts_as_live_here_until_long_after(
        channel: handed_results.Reader, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(handed_results.time, "monotonic", lambda: clock[0])
    assert handed_results.hand("a", 1, '"r"')
    assert channel.drain() == [handed_results.Finish("a", 1, '"r"')]
    assert handed_results.handed_here("a") and not handed_results.handed_here("b")
    clock[0] += handed_results.REMEMBER_SECONDS + 1
    assert not handed_results.handed_here("a")


def test_what_it_remembers_stays_bounded_by_the_window(
        channel: handed_results.Reader, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hand-over forgets up to two entries past the window: at any rate, only about a
    window's worth of keys is kept (a scan of everything per task would cost O(n))."""
    clock = [0.0]
    monkeypatch.setattr(handed_results.time, "monotonic", lambda: clock[0])
    for i in range(500):
        clock[0] += 1.0
        assert handed_results.hand(f"k{i}", 1, "1")
        channel.drain()
    assert len(handed_results._handed) <= handed_results.REMEMBER_SECONDS + 2
    assert handed_results.handed_here("k499") and not handed_results.handed_here("k0")


def test_records_come_out_whole_and_in_order(channel: handed_results.Reader) -> None:
    for i in range(100):
        assert handed_results.hand(f"key-{i}", i, None if i % 2 else f'"{i}"')
    got = channel.drain()
    assert [(f.work_key, f.epoch) for f in got] == [(f"key-{i}", i) for i in range(100)]
    assert got[1].result_json is None and got[2].result_json == '"2"'
