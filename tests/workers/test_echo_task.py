"""The echo model's `/task KIND {json}` command: one `start_task` call, then the tool's
result echoed. Pure: the model is called with no I/O."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given
from hypothesis import strategies as st

from workers.models import EchoModel, Message, ModelResponse, ToolCall
from workers.models.echo import TASK, tool_call_id


def user(text: str) -> Message:
    return Message("user", text)


def echo(messages: list[Message]) -> ModelResponse:
    return asyncio.run(EchoModel().complete(messages, []))


def start(index: int, kind: str, args: dict[str, object]) -> ToolCall:
    """The call echo makes for `/task KIND ARGS` in the user message at `index`."""
    arguments = {"kind": kind, "args": args}
    return ToolCall(tool_call_id(index, TASK, arguments), TASK, arguments)


def test_a_task_is_one_start_task_call() -> None:
    answer = echo(
        [
            user("hello"),
            Message("assistant", "echo: hello"),
            user('/task build {"target": "docs", "jobs": 4}'),
        ]
    )
    assert TASK == "start_task"
    expected = start(2, "build", {"target": "docs", "jobs": 4})
    assert (answer.text, answer.tool_calls, answer.finish_reason) == ("", [expected], "tool_calls")


def test_without_arguments_they_are_an_empty_object() -> None:
    for text in ("/task clean", "/task   clean  ", "/task clean {}"):
        (call,) = echo([user(text)]).tool_calls
        assert call == start(0, "clean", {}), text


def test_the_result_is_echoed() -> None:
    history = [user("/task clean")]
    (call,) = echo(history).tool_calls
    history += [
        Message("assistant", "", tool_calls=[call]),
        Message("tool", "started task t1 (clean); its outcome will arrive", tool_call_id=call.id),
    ]
    done = echo(history)
    assert (done.text, done.tool_calls, done.finish_reason) == (
        "echo: started task t1 (clean); its outcome will arrive",
        [],
        "stop",
    )


def test_a_malformed_task_is_echoed_whole() -> None:
    for text in (
        "/task",
        "/task   ",
        "/task build {not json",
        '/task build ["docs"]',
        "/task build 3",
        '/task build {"target": "docs"} trailing',
    ):
        answer = echo([user(text)])
        assert (answer.text, answer.tool_calls, answer.finish_reason) == (
            f"echo: {text}",
            [],
            "stop",
        ), text


def test_only_a_message_that_is_the_command_is_one() -> None:
    for text in ("/tasks build", "/taskbuild", " /task build", "please /task build"):
        answer = echo([user(text)])
        assert (answer.text, answer.tool_calls) == (f"echo: {text}", []), text


ARGS = st.dictionaries(
    st.text(min_size=1, max_size=8), st.one_of(st.text(max_size=20), st.integers()), max_size=4
)
KIND = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,20}", fullmatch=True)


@given(kind=KIND, args=ARGS)
def test_any_kind_and_object_make_the_call_echo_does(kind: str, args: dict[str, object]) -> None:
    answer = echo([user(f"/task {kind} {json.dumps(args)}")])
    assert answer.tool_calls == [start(0, kind, args)]
    assert answer.finish_reason == "tool_calls"
