"""The echo model's `/subagent TASK` command: one `spawn_subagent` call a line, all in one
answer, then the results echoed together. Pure: the model is called with no I/O."""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from workers.models import EchoModel, Message, ModelResponse, ToolCall
from workers.models.echo import SPAWN, tool_call_id


def user(text: str) -> Message:
    return Message("user", text)


def echo(messages: list[Message]) -> ModelResponse:
    return asyncio.run(EchoModel().complete(messages, []))


def spawn(index: int, task: str, line: int) -> ToolCall:
    """The call echo makes for `/subagent TASK` on `line` of the user message at `index`."""
    return ToolCall(tool_call_id(index, SPAWN, {"task": task, "line": line}), SPAWN, {"task": task})


def test_each_line_spawns_one_subagent_in_one_answer() -> None:
    history = [Message("system", "tools ahead"), user("/subagent count the files\n/subagent  sum")]
    answer = echo(history)
    calls = [spawn(1, "count the files", 0), spawn(1, "sum", 1)]
    assert (answer.text, answer.tool_calls, answer.finish_reason) == ("", calls, "tool_calls")
    assert SPAWN == "spawn_subagent"
    assert all(call.arguments == {"task": call.arguments["task"]} for call in answer.tool_calls)


def test_the_same_task_twice_is_two_calls_with_two_ids() -> None:
    answer = echo([user("/subagent look\n/subagent look")])
    assert [c.arguments for c in answer.tool_calls] == [{"task": "look"}, {"task": "look"}]
    assert len({c.id for c in answer.tool_calls}) == 2


def test_ids_are_deterministic_and_name_the_user_message() -> None:
    text = "/subagent a\n/subagent b"
    first, again = echo([user(text)]), echo([user(text)])
    assert first.tool_calls == again.tool_calls
    later = echo([user("hello"), Message("assistant", "echo: hello"), user(text)])
    assert {c.id for c in later.tool_calls}.isdisjoint(c.id for c in first.tool_calls)


def test_lines_of_other_text_are_left_out() -> None:
    answer = echo([user("/subagent one\nplease, and then\n  /subagent indented\n/subagent two\n")])
    assert answer.tool_calls == [spawn(0, "one", 0), spawn(0, "two", 3)]


def test_the_results_are_echoed_together_in_order() -> None:
    history = [user("/subagent a\n/subagent b")]
    calls = echo(history).tool_calls
    history += [
        Message("assistant", "", tool_calls=calls),
        Message("tool", "a found 3", tool_call_id=calls[0].id),
        Message("tool", "b failed", tool_call_id=calls[1].id),
    ]
    done = echo(history)
    assert (done.text, done.tool_calls, done.finish_reason) == (
        "echo: a found 3; b failed",
        [],
        "stop",
    )
    # A continuation note after the results (a crash between calls) changes nothing.
    noted = echo([*history, Message("user", "continue", note=True)])
    assert noted.text == "echo: a found 3; b failed"


def test_a_line_without_a_task_is_echoed_whole() -> None:
    for text in ("/subagent", "/subagent   ", "/subagent a\n/subagent", "/subagent\n/subagent b"):
        answer = echo([user(text)])
        assert (answer.text, answer.tool_calls, answer.finish_reason) == (
            f"echo: {text}",
            [],
            "stop",
        )


def test_only_a_message_that_starts_with_the_command_is_one() -> None:
    for text in ("/subagents a", "/subagentx a", " /subagent a", "first\n/subagent a"):
        answer = echo([user(text)])
        assert (answer.text, answer.tool_calls) == (f"echo: {text}", []), text


def test_the_other_commands_are_unchanged() -> None:
    tool = echo([user('/tool read_file {"path": "a"}')])
    assert tool.tool_calls == [
        ToolCall(tool_call_id(0, "read_file", {"path": "a"}), "read_file", {"path": "a"})
    ]
    assert echo([user("/sleep 0 up")]).text == "echo: up"
    assert echo([user("/long abcd")]).finish_reason == "length"
    assert echo([user("/tool")]).text == "echo: /tool"


LINE = st.text(st.characters(blacklist_characters="\n"), min_size=1).filter(str.strip)


@given(tasks=st.lists(LINE, min_size=1, max_size=8))
def test_every_task_line_is_one_call_with_its_own_id(tasks: list[str]) -> None:
    answer = echo([user("\n".join(f"/subagent {task}" for task in tasks))])
    assert [c.arguments["task"] for c in answer.tool_calls] == [t.strip() for t in tasks]
    assert [c.name for c in answer.tool_calls] == [SPAWN] * len(tasks)
    assert len({c.id for c in answer.tool_calls}) == len(tasks)
    assert answer.finish_reason == "tool_calls"
