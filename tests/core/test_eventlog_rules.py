"""The event log's session rules as pure code: no database."""

from __future__ import annotations

import pytest

from supervisor.store.events import SessionRow, advance, make_request


def row() -> SessionRow:
    return SessionRow(
        last_seq=0,
        lease_token=1,
        pending=False,
        active_turn_id=None,
        attempt_turn_id=None,
        attempt_count=0,
    )


def run(*events: tuple[str, str | None, dict[str, object]]) -> SessionRow:
    state = row()
    for type, turn, payload in events:
        advance(state, make_request("s", type, payload, turn_id=turn))
    return state


USER = ("user_message", None, {"text": "hi"})
START = ("turn_started", "t1", {})
END = ("turn_ended", "t1", {"outcome": "completed"})
CRASHED = ("continuation", "t1", {"cause": "worker_crash"})
HANDOFF = ("continuation", "t1", {"cause": "handoff"})


@pytest.mark.parametrize(
    ("events", "pending", "active", "attempts"),
    [
        ([USER], True, None, (None, 0)),
        ([USER, START], False, "t1", ("t1", 1)),
        ([USER, START, USER], True, "t1", ("t1", 1)),
        ([USER, START, END], False, None, (None, 0)),
        # A note charges nothing: recovery charged the attempt before the worker wrote it.
        ([USER, START, CRASHED], False, "t1", ("t1", 1)),
        ([USER, START, CRASHED, CRASHED], False, "t1", ("t1", 1)),
        ([USER, START, HANDOFF], False, "t1", ("t1", 1)),
        ([USER, START, CRASHED, END], False, None, (None, 0)),
        ([USER, START, END, USER, ("turn_started", "t2", {})], False, "t2", ("t2", 1)),
        ([("continuation", "t9", {"cause": "daemon_restart"})], False, None, (None, 0)),
    ],
)
def test_rules(
    events: list[tuple[str, str | None, dict[str, object]]],
    pending: bool,
    active: str | None,
    attempts: tuple[str | None, int],
) -> None:
    state = run(*events)
    assert state.last_seq == len(events)
    assert state.pending is pending
    assert state.active_turn_id == active
    assert (state.attempt_turn_id, state.attempt_count) == attempts


def test_turn_events_need_a_turn_id() -> None:
    with pytest.raises(ValueError, match="turn_id"):
        make_request("s", "turn_started", {})
