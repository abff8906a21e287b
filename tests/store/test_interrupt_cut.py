"""An interrupt's cut answer (`Sessions.interrupt` with what the turn streamed so far):
committed before `turn_ended` when the model call was cut, and not when its worker had
committed that answer already (the supervisor had not heard so yet: the same answer twice
would be a duplicate)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.store import Store

TURN = uuid.uuid4().hex


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 't.db'}", migrate=True) as opened:
        yield opened


def running(store: Store, *answers: str) -> str:
    """A session whose turn TURN is running, with `answers` committed in it."""
    sid = store.sessions.create("alice", title="cut").id
    store.events.append(sid, "user_message", {"text": "hi"}, writer="intake")
    store.events.append(sid, "turn_started", {"read_to": 1}, turn_id=TURN, writer="intake")
    for text in answers:
        payload = {"text": text, "tool_calls": []}
        store.events.append(sid, "model_response", payload, turn_id=TURN, writer="intake")
    return sid


def test_the_text_streamed_so_far_is_the_cut_answer_before_turn_ended(store: Store) -> None:
    sid = running(store)
    written = store.sessions.interrupt(sid, "alice", (TURN, "echo: h", False))
    assert [kind for _, kind in written] == ["model_response", "turn_ended"]
    cut = store.events.read(sid)[-2]
    assert cut.payload == {
        "text": "echo: h",
        "tool_calls": [],
        "finish_reason": "interrupted",
        "usage": {},
        "incomplete": True,
    }


def test_an_answer_committed_already_is_not_cut_again(store: Store) -> None:
    sid = running(store, "echo: hi there")
    written = store.sessions.interrupt(sid, "alice", (TURN, "echo: hi there", True))
    assert [kind for _, kind in written] == ["turn_ended"]


def test_text_of_another_turn_or_none_is_no_cut(store: Store) -> None:
    for streamed in ((uuid.uuid4().hex, "echo: h", True), (TURN, "", True), None):
        sid = running(store)
        written = store.sessions.interrupt(sid, "alice", streamed)
        assert [kind for _, kind in written] == ["turn_ended"], streamed
