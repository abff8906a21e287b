"""The echo model's `/restart REASON` command: one `request_restart` call, then the tool's
result echoed. Pure: the model is called with no I/O."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from workers.models import EchoModel, Message, ModelResponse, ToolCall
from workers.models.echo import RESTART, tool_call_id
from workers.restarting import TOOL


def user(text: str) -> Message:
    return Message("user", text)


def echo(messages: list[Message]) -> ModelResponse:
    return asyncio.run(EchoModel().complete(messages, []))


def request(index: int, reason: str) -> ToolCall:
    """The call echo makes for `/restart REASON` in the user message at `index`."""
    arguments = {"reason": reason}
    return ToolCall(tool_call_id(index, RESTART, arguments), RESTART, arguments)


def test_a_restart_is_one_request_restart_call() -> None:
    assert RESTART == TOOL == "request_restart"
    answer = echo([user("hello"), Message("assistant", "echo: hello"), user("/restart testing")])
    assert (answer.text, answer.tool_calls, answer.finish_reason) == (
        "",
        [request(2, "testing")],
        "tool_calls",
    )


def test_the_reason_is_the_rest_of_the_message_its_ends_stripped() -> None:
    for text, reason in (
        ("/restart new config, please ", "new config, please"),
        ("/restart   two  spaces", "two  spaces"),
        ("/restart line one\nline two", "line one\nline two"),
        ('/restart {"reason": "x"}', '{"reason": "x"}'),
    ):
        (call,) = echo([user(text)]).tool_calls
        assert call == request(0, reason), text


def test_the_result_is_echoed() -> None:
    history = [user("/restart testing")]
    (call,) = echo(history).tool_calls
    history += [
        Message("assistant", "", tool_calls=[call]),
        Message("tool", "restart r1 requested (reason: testing)", tool_call_id=call.id),
    ]
    done = echo(history)
    assert (done.text, done.tool_calls, done.finish_reason) == (
        "echo: restart r1 requested (reason: testing)",
        [],
        "stop",
    )


def test_without_a_reason_or_not_the_command_it_is_echoed_whole() -> None:
    for text in ("/restart", "/restart   ", "/restarts now", "/restartnow", " /restart now"):
        answer = echo([user(text)])
        assert (answer.text, answer.tool_calls, answer.finish_reason) == (
            f"echo: {text}",
            [],
            "stop",
        ), text


@given(reason=st.text(min_size=1, max_size=60).filter(lambda t: t.strip() == t and t != ""))
def test_any_reason_makes_the_call(reason: str) -> None:
    answer = echo([user(f"/restart {reason}")])
    assert answer.tool_calls == [request(0, reason)]
    assert answer.finish_reason == "tool_calls"
