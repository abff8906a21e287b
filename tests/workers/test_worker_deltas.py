"""A real worker process streams a turn's answer to its supervisor as `delta` messages.

The supervisor is a bare ROUTER of the test's (`FakeSupervisor`): it assigns a session
with a pending message and keeps every message the worker sends, in order. The model is
echo, then a real OpenAI-compatible server (llama-cpp-python's, `tests/model_server.py`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import multiprocess
import pytest

from supervisor.contract import control
from supervisor.contract.config import Config
from supervisor.store import EventRecord, Store
from tests.model_server import ModelServer, require
from tests.workers.test_mcp_start import FakeSupervisor, worker_spec
from workers.entry import run_worker

pytestmark = pytest.mark.timeout(240)
OWNER = "host/boot/w0.1"


def run_turn(tmp_path: Path, model: dict[str, Any], text: str) -> tuple[list[Any], Store, str]:
    """One turn of a new session in a real worker: what the worker said, the store, the
    session's id."""
    config = Config.model_validate({"pool": {"heartbeat_interval": 0.2}, "model": model})
    url = f"sqlite:///{tmp_path / 'turnkeeper.db'}"
    store = Store(url)
    session = store.sessions.create("alice").id
    lease = store.leases.acquire(session, OWNER, 300.0)
    assert lease is not None
    store.events.append(session, "user_message", {"text": text}, writer="intake")
    supervisor = FakeSupervisor(tmp_path / "control.sock")
    spec = worker_spec(supervisor, url, config)
    worker = multiprocess.get_context("spawn").Process(target=run_worker, args=(spec,))
    worker.start()
    try:
        supervisor.until("ready")
        assignment = {"session": session, "token": lease.token, "reason": "new"}
        supervisor.send("assign", sessions=[assignment])
        while not ended(supervisor.next()):
            pass
        supervisor.send("stop")
        worker.join(30)
        assert worker.exitcode == 0
        return supervisor.said, store, session
    finally:
        if worker.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
        supervisor.close()


def ended(message: Any) -> bool:
    return isinstance(message, control.Committed) and message.event_type == "turn_ended"


def deltas_and_answer(said: list[Any], store: Store, session: str) -> tuple[list[Any], str]:
    """The deltas the worker sent, checked against what it committed; the answer."""
    events: list[EventRecord] = store.events.read(session, 0, 1000)
    [turn] = {e.turn_id for e in events if e.type == "turn_started"}
    answers = [e for e in events if e.type == "model_response"]
    deltas = [m for m in said if isinstance(m, control.Delta)]
    assert {(d.session, d.turn) for d in deltas} == {(session, turn)}
    assert [d.index for d in deltas] == list(range(len(deltas)))
    answer = "".join(e.payload["text"] for e in answers)
    assert "".join(d.text for d in deltas) == answer  # none dropped here: all are there
    # Every delta went before the model_response it is part of was committed.
    last_delta = max(i for i, m in enumerate(said) if isinstance(m, control.Delta))
    committed = [
        i
        for i, m in enumerate(said)
        if isinstance(m, control.Committed) and m.event_type == "model_response"
    ]
    assert last_delta < committed[-1]
    return deltas, answer


def test_a_worker_streams_an_echo_answer_as_deltas_before_it_commits_it(
    tmp_path: Path,
) -> None:
    text = "one two three four five six seven eight nine ten"
    said, store, session = run_turn(tmp_path, {"provider": "echo", "delay": 0.5}, text)
    with store:
        deltas, answer = deltas_and_answer(said, store, session)
    assert answer == f"echo: {text}"
    # A word every 45 ms, a delta at most every 50 ms: several deltas, each of a few words.
    assert len(deltas) >= 3
    assert deltas[0].elapsed <= deltas[-1].elapsed


def test_a_tool_call_streams_by_name_cut_to_a_name_the_control_plane_takes(
    tmp_path: Path,
) -> None:
    name = "look\x01up" + "n" * 300  # the model's to make up: long, a control character
    said, store, session = run_turn(tmp_path, {"provider": "echo"}, f"/tool {name} {{}}")
    with store:
        deltas, answer = deltas_and_answer(said, store, session)
    [call] = [d.tool_call for d in deltas if d.tool_call]
    assert call.startswith("look\\x01upnnn") and call.endswith("…")
    assert len(call) == control.MAX_NAME
    assert answer.startswith("echo: ")  # the turn went on: the unknown tool's error echoed


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[ModelServer]:
    require()
    started = ModelServer(tmp_path / "model", 1024).start()
    try:
        yield started
    finally:
        started.stop()


def test_a_worker_streams_a_real_model_servers_answer_as_deltas(
    tmp_path: Path, model_server: ModelServer
) -> None:
    model = {
        "provider": "openai",
        "base_url": model_server.base_url,
        "model": "tiny",
        "max_tokens": 64,
        "timeout": 60,
    }
    said, store, session = run_turn(tmp_path, model, "hello there")
    with store:
        deltas, answer = deltas_and_answer(said, store, session)
        [response] = [e for e in store.events.read(session, 0, 100) if e.type == "model_response"]
    assert answer
    assert deltas
    assert response.payload["finish_reason"] in ("stop", "length")
    # llama-cpp-python's server sends no usage in a stream: the tokens are estimated.
    assert response.payload["tokens"] >= 1
