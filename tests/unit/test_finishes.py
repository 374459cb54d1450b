"""What a pool process remembers of the results it handed over (tasks/finishes.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_resilient.tasks import finishes


@pytest.fixture
def channel(monkeypatch: pytest.MonkeyPatch) -> Iterator[finishes.Reader]:
    finishes.open_channel()
    finishes.accepting(True)
    monkeypatch.setattr(finishes, "_handed", {})
    reader = finishes.Reader()
    yield reader
    reader.drain()
    finishes.accepting(False)


def test_a_result_handed_over_counts_as_live_here_until_long_after(
        channel: finishes.Reader, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(finishes.time, "monotonic", lambda: clock[0])
    assert finishes.hand("a", 1, '"r"')
    assert channel.drain() == [finishes.Finish("a", 1, '"r"')]
    assert finishes.handed_here("a") and not finishes.handed_here("b")
    clock[0] += finishes.REMEMBER_SECONDS + 1
    assert not finishes.handed_here("a")


def test_what_it_remembers_stays_bounded_by_the_window(
        channel: finishes.Reader, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each hand-over forgets up to two entries past the window: at any rate, only about a
    window's worth of keys is kept (a scan of everything per task would cost O(n))."""
    clock = [0.0]
    monkeypatch.setattr(finishes.time, "monotonic", lambda: clock[0])
    for i in range(500):
        clock[0] += 1.0
        assert finishes.hand(f"k{i}", 1, "1")
        channel.drain()
    assert len(finishes._handed) <= finishes.REMEMBER_SECONDS + 2
    assert finishes.handed_here("k499") and not finishes.handed_here("k0")


def test_records_come_out_whole_and_in_order(channel: finishes.Reader) -> None:
    for i in range(100):
        assert finishes.hand(f"key-{i}", i, None if i % 2 else f'"{i}"')
    got = channel.drain()
    assert [(f.work_key, f.epoch) for f in got] == [(f"key-{i}", i) for i in range(100)]
    assert got[1].result_json is None and got[2].result_json == '"2"'
