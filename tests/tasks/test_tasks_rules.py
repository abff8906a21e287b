"""The task rules without I/O: arguments checked against a kind's patterns (hostile values
included), the command rendered without a shell's splitting, the reconcile table, and an
outcome in words."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.core.vocabulary import TaskAction, TaskStatus
from supervisor.tasks.rules import (
    KindRules,
    TaskRefused,
    check_args,
    decide,
    hung_after,
    look_at,
    outcome_of,
    render,
    result_text,
    tail,
)

REPORT = KindRules(
    "report",
    ("make-report", "--days", "{days}", "--name={name}"),
    {"days": "^[0-9]{1,3}$", "name": "[a-z]+"},
)


def refusal(args: object, kind: KindRules = REPORT) -> str:
    with pytest.raises(TaskRefused) as info:
        check_args(kind, args)
    return str(info.value)


def test_arguments_matching_their_patterns_are_taken_as_strings() -> None:
    assert check_args(REPORT, {"days": 7, "name": "abc"}) == {"days": "7", "name": "abc"}
    assert check_args(KindRules("noargs", ("true",), {}), None) == {}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"days": "7"}, "needs the argument 'name'"),
        ({"days": "7", "name": "abc", "extra": "1"}, "takes no argument 'extra'"),
        ({"days": "7; rm -rf /", "name": "abc"}, "'days' of task kind 'report' does not match"),
        ({"days": "7", "name": "abc\n"}, "'name' of task kind 'report' does not match"),
        ({"days": "7", "name": "a\x00b"}, "no NUL"),
        ({"days": "", "name": "abc"}, "1 to 4096"),
        ({"days": True, "name": "abc"}, "a string or a number, not bool"),
        ({"days": ["7"], "name": "abc"}, "not list"),
        ({"days": {"$gt": 1}, "name": "abc"}, "not dict"),
        (["7"], "must be a JSON object, not list"),
        ("days=7", "must be a JSON object, not str"),
        ({f"a{i}": 1 for i in range(65)}, "too many arguments"),
        ({"days": "7", "name": "x" * 5000}, "1 to 4096"),
    ],
)
def test_bad_arguments_are_refused_naming_what_to_fix(args: object, says: str) -> None:
    assert says in refusal(args)


def test_a_pattern_matches_the_whole_value_not_a_part() -> None:
    assert "does not match" in refusal({"days": "7", "name": "abc-def"})
    assert "does not match" in refusal({"days": "1234", "name": "abc"})


def test_rendering_puts_each_value_in_place_and_never_splits_or_rereads_it() -> None:
    assert render(REPORT.command, {"days": "7", "name": "abc"}) == [
        "make-report",
        "--days",
        "7",
        "--name=abc",
    ]
    # A value holding braces or spaces stays one element, and is not substituted again.
    argv = render(("echo", "{a}", "x{b}y"), {"a": "{b} and more", "b": "$(id)"})
    assert argv == ["echo", "{b} and more", "x$(id)y"]


@given(st.dictionaries(st.sampled_from(["a", "b"]), st.text(min_size=1, max_size=50), min_size=2))
def test_rendering_yields_as_many_elements_as_the_command_has(values: dict[str, str]) -> None:
    command = ("prog", "{a}", "--b={b}", "{a}{b}")
    argv = render(command, values)
    assert len(argv) == len(command)
    assert argv[1] == values["a"] and argv[3] == values["a"] + values["b"]


LIVE = {"reported": False, "lost_grace": 60.0, "retry_on_restart": False, "attempt": 1}


@pytest.mark.parametrize(
    ("status", "facts", "action"),
    [
        ("pending", {}, TaskAction.START),
        ("running", {"heard_ago": 5.0}, None),
        ("running", {"heard_ago": 59.9}, None),
        ("running", {"heard_ago": 60.0}, TaskAction.LOST),
        ("running", {"heard_ago": None}, TaskAction.LOST),
        ("running", {"heard_ago": 61.0, "retry_on_restart": True}, TaskAction.RETRY),
        ("running", {"heard_ago": 61.0, "retry_on_restart": True, "attempt": 2}, TaskAction.LOST),
        (
            "running",
            {"heard_ago": 61.0, "retry_on_restart": True, "cancel_requested": True},
            TaskAction.LOST,
        ),
        ("succeeded", {}, TaskAction.REPORT),
        ("lost", {}, TaskAction.REPORT),
        ("cancelled", {"reported": True}, None),
        ("failed", {"reported": True, "heard_ago": 1e9}, None),
    ],
)
def test_the_reconcile_table(status: str, facts: dict[str, object], action: object) -> None:
    given_facts = {**LIVE, "heard_ago": None, "cancel_requested": False, **facts}
    assert decide(status, **given_facts) is action  # type: ignore[arg-type]


@given(
    st.sampled_from(list(TaskStatus)),
    st.booleans(),
    st.none() | st.floats(min_value=0, max_value=1e6),
    st.booleans(),
    st.integers(min_value=1, max_value=3),
    st.booleans(),
)
def test_a_final_task_is_never_started_or_lost_again(
    status: TaskStatus,
    reported: bool,
    heard_ago: float | None,
    retry: bool,
    attempt: int,
    cancel: bool,
) -> None:
    action = decide(
        status,
        reported=reported,
        heard_ago=heard_ago,
        lost_grace=60.0,
        retry_on_restart=retry,
        attempt=attempt,
        cancel_requested=cancel,
    )
    if status.final:
        assert action is (None if reported else TaskAction.REPORT)
    if action is TaskAction.RETRY:
        assert retry and attempt == 1 and not cancel


@given(st.floats(min_value=0, max_value=2e9), st.floats(min_value=0.1, max_value=1e5))
def test_a_running_task_falls_due_when_the_table_first_moves_it_on(
    heard_at: float, grace: float
) -> None:
    """The keeper rests until `look_at` (and a loop wakes 10 ms past a rest): by then
    `decide` says lost, and just before it did not."""
    due = look_at(heard_at, ours=False, lost_grace=grace, kill_grace=5.0)
    assert due is not None

    def action(at: float) -> TaskAction | None:
        facts = {**LIVE, "lost_grace": grace, "cancel_requested": False}
        return decide("running", heard_ago=at - heard_at, **facts)  # type: ignore[arg-type]

    assert action(due + 0.001) is TaskAction.LOST
    assert action(heard_at + grace * 0.999) is None


def test_a_live_runner_of_ours_falls_due_when_it_would_be_hung() -> None:
    assert hung_after(60.0, 5.0) == 95.0
    assert look_at(1000.0, ours=True, lost_grace=60.0, kill_grace=5.0) == 1095.0
    assert look_at(1000.0, ours=False, lost_grace=60.0, kill_grace=5.0) == 1060.0
    assert look_at(None, ours=False, lost_grace=60.0, kill_grace=5.0) is None  # due now


def test_outcomes_of_a_command_that_ended() -> None:
    assert outcome_of(0, False, False) is TaskStatus.SUCCEEDED
    assert outcome_of(2, False, False) is TaskStatus.FAILED
    assert outcome_of(-9, False, False) is TaskStatus.FAILED
    assert outcome_of(-15, True, False) is TaskStatus.TIMED_OUT
    assert outcome_of(-15, True, True) is TaskStatus.CANCELLED


def test_an_outcome_in_words() -> None:
    text = result_text("t1", "report", "failed", exit_code=3, duration=2.25, output_tail="oops\n")
    assert text.startswith("task t1 (report) failed (exit status 3) after 2.2 s.")
    assert text.endswith("Output (its end):\noops\n")
    assert "(signal 9)" in result_text("t1", "report", "failed", exit_code=-9)
    assert "exit status" not in result_text("t1", "report", "succeeded", exit_code=0)
    lost = result_text("t1", "report", "lost", reason="its runner stopped")
    assert lost == "task t1 (report) was lost.\nits runner stopped."


def test_the_tail_is_the_end_without_nuls() -> None:
    assert tail("ab\x00c", 10) == "abc"
    assert tail("x" * 10 + "end", 3) == "end"
