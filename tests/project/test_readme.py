"""The docs' promises that code can check: the example agent of the tutorial (docs/tutorial/
agent.md) runs as documented."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from tests.conftest import REPO
from workers.models import EchoModel, Message
from workers.tools import BuiltinTools
from workers.turns import TurnContext, run_agent


def example_agent() -> Any:
    page = (REPO / "docs" / "tutorial" / "agent.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S)
    assert code, "docs/tutorial/agent.md has no example agent"
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), "docs/tutorial/agent.md", "exec"), namespace)
    return namespace["CarefulAgent"]()


def run(agent: Any, text: str) -> list[tuple[str, dict[str, Any]]]:
    committed: list[tuple[str, dict[str, Any]]] = []

    async def commit(type: str, payload: dict[str, Any], turn_id: str | None) -> int:
        committed.append((type, payload))
        return len(committed)

    context = TurnContext(
        "s", "t", [Message("user", text)], EchoModel(), BuiltinTools(), commit, asyncio.Event()
    )
    asyncio.run(run_agent(agent, context, commit))
    return committed


def test_the_example_agent_runs_read_only_tools() -> None:
    committed = run(example_agent(), '/tool echo {"a": 1}')
    assert [t for t, _ in committed] == [
        "model_response",
        "tool_call",
        "tool_result",
        "model_response",
        "turn_ended",
    ]
    assert committed[-2][1]["text"] == 'echo: {"a": 1}'
    assert committed[-1][1]["outcome"] == "completed"


def test_the_example_agent_answers_plain_messages() -> None:
    committed = run(example_agent(), "hi")
    assert committed[0][1]["text"] == "echo: hi"
    assert committed[-1] == ("turn_ended", {"outcome": "completed"})
