"""One tail classifier for both sides: the supervisor and the worker agree on when a turn
is answered, whatever its events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.tail import Resume, TailClass, classify_tail, resume_from
from workers import history


@dataclass(frozen=True)
class Ev:
    type: str
    turn_id: str | None = "t1"
    payload: dict[str, Any] = field(default_factory=dict)


STEPS = st.sampled_from(
    [
        Ev("model_response", payload={"text": "done", "finish_reason": "stop"}),
        Ev("model_response", payload={"text": "do", "finish_reason": "length"}),
        Ev("model_response", payload={"tool_calls": [{"id": "c1", "name": "echo"}]}),
        Ev("tool_call", payload={"call_id": "c1"}),
        Ev("tool_result", payload={"call_id": "c1", "content": "x"}),
        Ev("notice", payload={"text": "x"}),
        Ev("user_message", turn_id=None, payload={"text": "next"}),
    ]
)


@given(st.lists(STEPS, max_size=8))
def test_both_sides_agree_on_an_answered_turn(steps: list[Ev]) -> None:
    events = [Ev("turn_started"), *steps]
    supervisor = classify_tail(events, "t1")
    worker = history.classify_tail(events)  # type: ignore[arg-type]
    assert (supervisor is TailClass.ANSWERED) == (worker is Resume.ANSWERED)
    assert (supervisor is TailClass.CUT_BY_MAX_TOKENS) == (worker is Resume.TRUNCATED)


def test_the_worker_reads_past_an_earlier_attempts_note() -> None:
    events = [Ev("turn_started"), Ev("tool_result", payload={"call_id": "c1"}), Ev("continuation")]
    assert classify_tail(events, "t1") is TailClass.LAST_IS_CONTINUATION_NOTE  # recovery: unsafe
    assert resume_from(events) is Resume.RUN  # the worker, told to go on: call the model
