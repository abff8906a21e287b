"""Traces of turns with the daemon as a real process and a real OTLP/HTTP receiver on
loopback (`tests.otlp_receiver`): one trace per run of a turn, the worker's model and tool
spans children of the supervisor's root, a continuation after a SIGKILL linked to the run
it continues, no content unless asked for; a receiver that never answers delays neither
turns nor the stop.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.traces import run_root
from supervisor.store import Store
from tests.daemon import Daemon, daemons, events, turn_ended, wait_until
from tests.otlp_receiver import Receiver, Span

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(180)
SECRET = "zebra-quartz-7731"  # in the message, the tool's arguments and result, the answer


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    made = Receiver()
    yield made
    made.close()


def traced(daemons: Daemons, endpoint: str, gate: Path, **telemetry: Any) -> Daemon:
    daemon = daemons(
        agent={"class": "tests.agents_traced:GatedAfterTools"},
        telemetry={"otlp_endpoint": endpoint, **telemetry},
        log={"format": "json"},
        pool={"workers": 1, "spare": 0},
    )
    # Spans leave each process 50 ms after they end, not 5 s: the test sees them at once.
    daemon.env = {"OTEL_BSP_SCHEDULE_DELAY": "50", "TURNKEEPER_TEST_GATE": str(gate)}
    return daemon


def session_with(daemon: Daemon, text: str) -> str:
    with daemon.client() as http:
        session = http.post("/v1/sessions", json={"title": "traced"}).json()["id"]
        assert http.post(f"/v1/sessions/{session}/inject", json={"text": text}).status_code == 202
    return str(session)


def tool_message() -> str:
    return "/tool echo " + json.dumps({"text": SECRET})


def runs(receiver: Receiver, session: str) -> list[Span]:
    return [s for s in receiver.named("turn") if s.attributes["turnkeeper.session.id"] == session]


def children(receiver: Receiver, span: Span) -> list[Span]:
    return [s for s in list(receiver.spans) if s.parent == span.span_id]


def test_a_turn_killed_with_its_worker_is_two_linked_traces_with_no_content(
    daemons: Daemons, receiver: Receiver, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    daemon = traced(daemons, receiver.endpoint, gate).start()
    session = session_with(daemon, tool_message())
    store = Store(daemon.url, migrate=False)
    try:
        # The first run: its model call asked for the tool, the tool ran, and the turn is
        # held at the gate; the worker's spans of both are exported before the kill.
        tool = wait_until(lambda: receiver.named("execute_tool echo"), 30, "the tool's span")[0]
        wait_until(lambda: receiver.named("chat echo"), 30, "the model call's span")
        pid = daemon.owner_pid(store, session)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        gate.touch()  # the continuation goes on past the gate
        ended = wait_until(lambda: turn_ended(store, session), 60, "the continued turn to end")
        assert ended.payload["outcome"] == "completed"
        log = events(store, session)
        wait_until(lambda: len(runs(receiver, session)) == 2, 30, "both runs' root spans")
    finally:
        store.close()
    first, second = sorted(runs(receiver, session), key=lambda s: s.start_ns)
    opened = [e for e in log if e.type in ("turn_started", "continuation")]
    assert [e.type for e in opened] == ["turn_started", "continuation"]
    turn = opened[0].turn_id
    assert turn is not None

    # One trace per run, named by the turn and the event that opened it; the supervisor's
    # root has no parent, and says which turn, which attempt and what started it.
    for root, event in ((first, opened[0]), (second, opened[1])):
        ids = run_root(turn, event.seq)
        assert (root.trace_id, root.span_id) == (f"{ids.trace_id:032x}", f"{ids.span_id:016x}")
        assert root.parent == "" and root.process == "supervisor"
        assert root.attributes["turnkeeper.turn.id"] == turn
    assert first.attributes["turnkeeper.turn.trigger"] == "intake"
    assert second.attributes["turnkeeper.turn.trigger"] == "recovery"
    assert first.attributes["turnkeeper.turn.attempt"] == 1
    assert second.attributes["turnkeeper.turn.attempt"] == 2
    assert first.status == 2  # error: its worker died under it
    assert first.attributes["error.type"] == "worker_exited"
    assert second.status != 2

    # The continuation links to the run it continues; the first run links to the request.
    assert (first.trace_id, first.span_id) in second.links
    (inject,) = receiver.named("POST /v1/sessions/{id}/inject")
    assert (inject.trace_id, inject.span_id) in first.links
    assert inject.trace_id != first.trace_id

    # The worker's model and tool calls are the root's children, with the gen_ai
    # attributes (its span of the agent's run was in flight at the SIGKILL: lost).
    under = children(receiver, first)
    assert not [s for s in under if s.name.startswith("invoke_agent")]
    chat = next(s for s in under if s.name == "chat echo")
    assert chat.process.startswith("w")
    assert tool in under and tool.trace_id == first.trace_id
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.provider.name"] == "echo"
    assert chat.attributes["gen_ai.request.model"] == "echo"
    assert chat.attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert isinstance(chat.attributes["gen_ai.usage.input_tokens"], int)
    assert isinstance(chat.attributes["gen_ai.usage.output_tokens"], int)
    assert tool.attributes["gen_ai.tool.name"] == "echo"
    assert tool.attributes["turnkeeper.tool.outcome"] == "ok"
    # The continued run's agent span ended: it says so, and its answer is a sibling. The
    # worker exports them on its own schedule, after the supervisor's root may have gone.
    wait_until(
        lambda: {"invoke_agent", "chat"} <= {s.name.split()[0] for s in children(receiver, second)},
        30,
        "the continued run's agent and model spans",
    )
    (again,) = [s for s in children(receiver, second) if s.name.startswith("invoke_agent")]
    assert again.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert again.attributes["turnkeeper.turn.continued"] is True
    assert "turnkeeper.continuation" in again.events
    answer = [s for s in children(receiver, second) if s.name == "chat echo"]
    assert answer and answer[0].attributes["gen_ai.response.finish_reasons"] == ["stop"]

    # No content anywhere: not in an attribute, an event, a link or a resource.
    assert receiver.spans and all(SECRET not in s.raw for s in receiver.spans)
    assert not any(SECRET.encode() in body for body in receiver.bodies)

    # The JSON log lines written during a run name its trace.
    lines = [json.loads(x) for x in daemon.log().splitlines() if x.startswith("{")]
    answered = [line for line in lines if line["message"] == "the model answered"]
    assert (again.trace_id, again.span_id) in [(x["trace_id"], x["span_id"]) for x in answered]
    ready = [line for line in lines if line["message"].startswith("ready as ")]
    assert ready and not [line for line in ready if "trace_id" in line]  # in no span


def test_content_is_exported_when_asked_for(
    daemons: Daemons, receiver: Receiver, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    daemon = traced(daemons, receiver.endpoint, gate, capture_content=True).start()
    session = session_with(daemon, tool_message())
    store = Store(daemon.url, migrate=False)
    try:
        wait_until(lambda: turn_ended(store, session), 60, "the turn to end")
    finally:
        store.close()
    tool = wait_until(lambda: receiver.named("execute_tool echo"), 30, "the tool's span")[0]
    assert SECRET in tool.attributes["gen_ai.tool.call.arguments"]
    assert SECRET in tool.attributes["gen_ai.tool.call.result"]
    chat = wait_until(lambda: receiver.named("chat echo"), 30, "the model call's span")[0]
    assert SECRET in chat.attributes["gen_ai.input.messages"]


def test_a_receiver_that_never_answers_delays_no_turn_and_not_the_stop(
    daemons: Daemons, tmp_path: Path
) -> None:
    hung = Receiver(hang=True)
    try:
        gate = tmp_path / "gate"
        gate.touch()
        daemon = traced(daemons, hung.endpoint, gate).start()
        store = Store(daemon.url, migrate=False)
        try:
            sessions = [session_with(daemon, f"{tool_message()} {n}") for n in range(3)]
            for session in sessions:
                wait_until(lambda s=session: turn_ended(store, s), 30, "a turn to end")
        finally:
            store.close()
        assert hung.requests >= 1  # it was sent spans, and answered none

        def dropped() -> float:
            with daemon.client() as http:
                text = http.get("/metrics").text
            return sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("turnkeeper_spans_dropped_total")
            )

        wait_until(dropped, 30, "spans counted as dropped")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
        log = daemon.log()
        assert "telemetry flush" in log
    finally:
        hung.close()


def test_with_tracing_off_a_worker_imports_no_opentelemetry(daemons: Daemons) -> None:
    daemon = daemons(agent={"class": "tests.agents_traced:GatedAfterTools"}).start()
    session = session_with(daemon, "/otel-modules")
    store = Store(daemon.url, migrate=False)
    try:
        wait_until(lambda: turn_ended(store, session), 30, "the turn to end")
        notices = [e.payload["text"] for e in events(store, session) if e.type == "notice"]
    finally:
        store.close()
    assert notices == ["modules: none"]
