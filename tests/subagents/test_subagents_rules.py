"""The rules of a subagent's run (`supervisor.subagents.rules`), without a database: the
limits, the outcome a parent reads, the reconcile table, and recovery's settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from supervisor.core.vocabulary import SubagentStatus
from supervisor.subagents.rules import (
    RESULT_MAX,
    TASK_MAX,
    Child,
    Settings,
    Step,
    check_task,
    final_status,
    outcome,
    reconcile,
    refusal,
    result_text,
)


@dataclass(frozen=True)
class Ev:
    type: str
    turn_id: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)


def ended(turn: str, result: str, **payload: Any) -> Ev:
    return Ev("turn_ended", turn, {"outcome": result, **payload})


@pytest.mark.parametrize(
    ("depth", "running", "max_depth", "max_children", "why"),
    [
        (0, 0, 2, 8, None),
        (1, 7, 2, 8, None),  # a child may spawn, below both limits
        (2, 0, 2, 8, "at subagent depth 2; subagents.max_depth is 2"),
        (0, 0, 0, 8, "subagents are turned off here (subagents.max_depth = 0)"),
        (0, 8, 2, 8, "has 8 subagents running, the limit (subagents.max_children) is 8"),
        (0, 0, 1, 0, "has 0 subagents running"),
        (2, 9, 2, 8, "max_depth"),  # depth is judged first
    ],
)
def test_refusal(depth: int, running: int, max_depth: int, max_children: int, why: str) -> None:
    found = refusal(depth, running, max_depth=max_depth, max_children=max_children)
    if why is None:
        assert found is None
    else:
        assert found is not None and why in found


def test_a_task_is_a_non_empty_string_within_the_limit() -> None:
    assert check_task("do it") == "do it"
    for bad in ("", "   \n", None, 3, ["a"]):
        with pytest.raises(ValueError, match="non-empty string"):
            check_task(bad)
    assert check_task("x" * TASK_MAX) == "x" * TASK_MAX
    with pytest.raises(ValueError, match=f"at most {TASK_MAX}"):
        check_task("x" * (TASK_MAX + 1))


def test_a_completed_run_gives_the_last_answer_of_its_last_turn() -> None:
    log = [
        Ev("user_message", None, {"text": "task"}),
        Ev("turn_started", "t1"),
        Ev("model_response", "t1", {"text": "thinking"}),
        Ev("model_response", "t1", {"text": "first answer"}),
        ended("t1", "completed"),
        Ev("turn_started", "t2"),
        Ev("model_response", "t2", {"text": "final answer"}),
        Ev("notice", "t2", {"text": "unrelated"}),
        ended("t2", "truncated"),
    ]
    assert outcome("open", log) == (SubagentStatus.COMPLETED, "final answer")
    assert outcome("closed", log[:5]) == (SubagentStatus.COMPLETED, "first answer")
    # A turn with no answer of its own does not borrow an earlier turn's.
    silent = [*log[:5], Ev("turn_started", "t2"), ended("t2", "completed")]
    assert outcome("open", silent) == (SubagentStatus.COMPLETED, "")
    long = [Ev("model_response", "t", {"text": "y" * (RESULT_MAX + 50)}), ended("t", "completed")]
    status, text = outcome("open", long)
    assert status is SubagentStatus.COMPLETED and len(text) == RESULT_MAX


@pytest.mark.parametrize(
    ("status", "log", "expected", "says"),
    [
        (None, [], SubagentStatus.FAILED, "no longer exists"),
        ("quarantined", [ended("t", "completed")], SubagentStatus.WEDGED, "failed every time"),
        ("closed", [Ev("user_message")], SubagentStatus.CANCELLED, "closed before it ran"),
        ("open", [Ev("user_message")], SubagentStatus.FAILED, "without running a turn"),
        ("open", [ended("t", "interrupted_by_operator", by="bob")], SubagentStatus.CANCELLED,
         "interrupted by bob"),
        ("open", [ended("t", "interrupted_by_operator")], SubagentStatus.CANCELLED,
         "interrupted by an operator"),
        ("open", [ended("t", "failed", error="boom")], SubagentStatus.FAILED,
         "its turn ended failed: boom"),
        ("open", [ended("t", "failed", reason="stale")], SubagentStatus.FAILED, "failed: stale"),
        ("open", [ended("t", "failed")], SubagentStatus.FAILED, "its turn ended failed"),
    ],
)  # fmt: skip
def test_outcomes_that_are_not_an_answer(
    status: str | None, log: list[Ev], expected: SubagentStatus, says: str
) -> None:
    found, text = outcome(status, log)
    assert found is expected and says in text


@pytest.mark.parametrize(
    ("child", "step"),
    [
        (Child(None), Step.REPORT),  # 1: gone
        (Child("closed", "t1", True), Step.REPORT),  # 2: not open, whatever it holds
        (Child("quarantined", "t1"), Step.REPORT),
        (Child("open", "t1"), Step.RECOVER),  # 3: a turn in flight
        (Child("open", "t1", True), Step.RECOVER),
        (Child("open", None, True), Step.WAIT),  # 4: pending input
        (Child("open"), Step.REPORT),  # 5: idle
    ],
)
def test_the_reconcile_table(child: Child, step: Step) -> None:
    assert reconcile(child) is step


def test_what_giving_up_on_a_turn_makes_the_child() -> None:
    assert final_status(quarantine=True, stale=True) is SubagentStatus.WEDGED
    assert final_status(quarantine=True, stale=False) is SubagentStatus.WEDGED
    assert final_status(quarantine=False, stale=True) is SubagentStatus.FINALIZED
    assert final_status(quarantine=False, stale=False) is SubagentStatus.FAILED


def test_settings_repeat_the_last_delay_for_more_attempts() -> None:
    more = Settings(True, (0.0, 5.0, 30.0), 7200.0, 5)
    assert (more.auto_continue, more.freshness) == (True, 7200.0)
    assert more.attempt_delays == (0.0, 5.0, 30.0, 30.0, 30.0)
    assert Settings(False, (0.0, 5.0, 30.0), 60.0, 2).attempt_delays == (0.0, 5.0)
    assert Settings(True, (), 60.0, 2).attempt_delays == (0.0, 0.0)
    assert Settings(True, (1.0,), 60.0, 0).attempt_delays == ()


def test_a_result_as_the_parent_reads_it() -> None:
    payload = {"subagent": "c1", "status": "completed", "text": "42", "title": "files"}
    assert result_text(payload) == "[subagent c1 (files) completed] 42"
    assert result_text({"subagent": "c1", "status": "failed", "text": "boom"}) == (
        "[subagent c1 failed] boom"
    )


def test_with_auto_continue_off_a_child_recovery_would_continue_is_given_up_on() -> None:
    """Nobody resumes a child by hand: where only auto_continue = false leaves its turn
    alone, the child ends (failed) and its parent is told; everything else is recovery's."""
    from supervisor.core.notices import subagent_notice
    from supervisor.core.recovery import Action, Interruption, Trigger
    from supervisor.core.tail import TailClass
    from supervisor.subagents.rules import AUTO_CONTINUE_OFF, decide

    now = 10_000.0
    fresh = Interruption("turn-1", TailClass.UNANSWERED_USER_MESSAGE, now - 5)
    on = Settings(True, (0.0, 5.0, 30.0), 7200.0, 3)
    off = Settings(False, (0.0, 5.0, 30.0), 7200.0, 3)
    assert decide(fresh, Trigger.SUBAGENT_RESUME, now, False, on).action is Action.CONTINUE
    given_up = decide(fresh, Trigger.SUBAGENT_RESUME, now, False, off)
    assert (given_up.action, given_up.reason) == (Action.NOTICE_RESEND, AUTO_CONTINUE_OFF)
    told = subagent_notice(given_up, fresh)
    assert (told.outcome, told.reason) == ("failed", "auto_continue_off")
    assert "auto_continue" in told.text
    # What recovery skips anyway stays a SKIP: a live lease, a tripped breaker.
    live = Interruption("turn-1", TailClass.UNANSWERED_USER_MESSAGE, now - 5, lease_live=True)
    assert decide(live, Trigger.SUBAGENT_RESUME, now, False, off).action is Action.SKIP
    assert decide(fresh, Trigger.SUBAGENT_RESUME, now, True, off).action is Action.SKIP


def test_a_child_that_died_again_right_after_its_note_is_continued_within_its_attempts() -> None:
    from supervisor.core.recovery import Action, Interruption, Trigger
    from supervisor.core.tail import TailClass
    from supervisor.subagents.rules import decide

    now = 10_000.0
    settings = Settings(True, (0.0, 0.0, 0.0), 7200.0, 3)
    note = Interruption("turn-1", TailClass.LAST_IS_CONTINUATION_NOTE, now - 1, attempts=1)
    assert decide(note, Trigger.WORKER_DEATH, now, False, settings).action is Action.CONTINUE
    spent = Interruption("turn-1", TailClass.LAST_IS_CONTINUATION_NOTE, now - 1, attempts=3)
    last = decide(spent, Trigger.WORKER_DEATH, now, False, settings)
    assert last.action is Action.NOTICE_RESEND and last.quarantine  # wedged


def test_with_auto_continue_off_a_stale_child_is_still_finalized() -> None:
    from supervisor.core.recovery import Action, Interruption, Trigger
    from supervisor.core.tail import TailClass
    from supervisor.subagents.rules import decide

    now = 10_000.0
    stale = Interruption("turn-1", TailClass.UNANSWERED_USER_MESSAGE, now - 7201)
    off = Settings(False, (0.0, 5.0, 30.0), 7200.0, 3)
    decision = decide(stale, Trigger.SUBAGENT_RESUME, now, False, off)
    assert decision.action is Action.FINALIZE_STALE
