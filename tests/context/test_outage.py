"""Model outages without I/O (issue 29): the wait's schedule and budget, a turn that
waits out a server that is down with one notice and no attempt spent, and a budget spent."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from supervisor.store import EventRecord
from workers.models import SILENT, Message, ModelError, ModelResponse, Stream, ToolSpec
from workers.outage import DELAYS, NOTICE, Health, Outage, outage_since
from workers.tools import BuiltinTools
from workers.turns import TurnContext


def down(retry_after: float | None = None) -> ModelError:
    error = ModelError("model server http://127.0.0.1:9/v1 answered 503: busy", transient=True)
    error.retry_after = retry_after
    return error


def test_the_waits_grow_honour_retry_after_and_stop_at_the_budget() -> None:
    outage = Outage(budget=60.0, since=1000.0)
    assert [outage.wait(down(), 1000.0) for _ in range(3)] == list(DELAYS[:3])
    assert outage.wait(down(retry_after=20.0), 1010.0) == 20.0
    assert outage.wait(down(retry_after=20.0), 1050.0) == 10.0  # what is left of the budget
    assert outage.wait(down(), 1060.0) is None
    assert Outage(60.0).wait(ModelError("answered 400: bad request"), 0.0) is None
    spent = Outage(60.0, since=1.0).spent(down())
    assert not spent.transient and "model.outage_budget" in str(spent)


def test_the_outage_a_turn_was_waiting_out_is_read_back_from_its_events() -> None:
    def ev(seq: int, type: str, payload: dict[str, Any]) -> EventRecord:
        return EventRecord("s", seq, type, "t", payload, 0.0, "worker")

    waiting = [ev(1, "turn_started", {}), ev(2, "notice", {"text": NOTICE, "outage_since": 5.0})]
    assert outage_since(waiting) == 5.0
    assert outage_since([*waiting, ev(3, "model_response", {"text": "hi"})]) is None


class FlakyModel:
    """Down for its first `failures` calls, then answering."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        self.calls += 1
        if self.calls <= self.failures:
            raise down(retry_after=0.01)
        return ModelResponse("back", [], "stop", {})

    async def aclose(self) -> None:
        pass


def turn_with(model: FlakyModel, outage: Outage, health: Health) -> tuple[TurnContext, list[Any]]:
    committed: list[tuple[str, dict[str, Any]]] = []

    async def commit(type: str, payload: dict[str, Any], turn: str | None) -> int:
        committed.append((type, payload))
        return len(committed)

    context = TurnContext(
        "s", "t", [Message("user", "hi")], model, BuiltinTools(), commit, asyncio.Event(),
        outage=outage, health=health,
    )  # fmt: skip
    return context, committed


def test_a_turn_waits_out_an_outage_with_one_notice() -> None:
    model, health = FlakyModel(failures=4), Health()
    seen: list[float | None] = []

    async def run() -> ModelResponse:
        context, committed = turn_with(model, Outage(budget=30.0), health)
        call = asyncio.ensure_future(context.call_model())
        while health.down_since is None and not call.done():
            await asyncio.sleep(0.001)
        seen.append(health.down_since)
        response = await call
        assert [t for t, _ in committed] == ["notice", "model_response"]
        assert committed[0][1]["text"] == NOTICE
        return response

    assert asyncio.run(run()).text == "back"
    assert model.calls == 5 and seen[0] is not None and health.down_since is None


def test_past_the_budget_the_turn_fails_with_the_last_error_not_to_be_retried() -> None:
    model = FlakyModel(failures=10**6)
    context, committed = turn_with(model, Outage(budget=0.05), Health())
    with pytest.raises(ModelError) as failed:
        asyncio.run(context.call_model())
    assert not failed.value.transient and "answered 503" in str(failed.value)
    assert [t for t, _ in committed] == ["notice"] and model.calls >= 2
