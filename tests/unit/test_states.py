"""The work state machine as data: consistent with itself and with docs/architecture.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_resilient.core import states

DOC = Path(__file__).parents[2] / "docs" / "architecture.md"


def test_every_transition_is_documented_exactly() -> None:
    text = DOC.read_text()
    for t in states.TRANSITIONS:
        row = f"| `{t.name}` | {', '.join(t.sources)} | {t.target} | {t.who} | {t.why} |"
        assert row in text, f"docs/architecture.md lacks or misstates transition {t.name}"


def test_states_partition() -> None:
    assert set(states.OPEN_STATES).isdisjoint(states.TERMINAL_STATES)
    assert set(states.ALL_STATES) == set(states.OPEN_STATES) | set(states.TERMINAL_STATES)
    assert set(states.STOPPED_STATES) <= set(states.ENDED_BY_REQUEST)


def test_every_state_is_reachable_and_every_target_is_a_state() -> None:
    targets = {t.target for t in states.TRANSITIONS}
    assert targets == set(states.ALL_STATES)
    for t in states.TRANSITIONS:
        assert set(t.sources) <= {*states.ALL_STATES, states.NEW}, t.name


def test_terminal_states_reopen_only_by_a_new_request_or_an_operator() -> None:
    for t in states.TRANSITIONS:
        left = set(t.sources) & set(states.TERMINAL_STATES)
        if not left:
            continue
        assert states.DONE not in left, "done work never changes"
        if t.target in states.OPEN_STATES:
            assert t.name in ("restart", "retry"), t.name
        else:  # terminal to terminal: only Celery's expiry relabelling its own revoke
            assert (t.name, left, t.target) == ("expire", {states.REVOKED}, states.EXPIRED)


@pytest.mark.parametrize(("name", "state", "ok"), [
    ("take", None, True), ("take", "requeued", True), ("take", "done", False),
    ("cancel", "running", True), ("cancel", "done", False), ("orphan", "dead", False),
    ("restart", "failed", True), ("restart", "dead", False), ("retry", "done", False),
])
def test_allowed(name: str, state: str | None, ok: bool) -> None:
    assert states.allowed(name, state) is ok
