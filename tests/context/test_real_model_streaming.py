"""Live output from a real OpenAI-compatible server (llama-cpp-python's, streaming with
`stream: true`), through a real daemon to a client attached over HTTP: the turn's deltas
come before its `turn_ended`, carry no `id:`, and joined they are the committed answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from supervisor.store import Store
from tests.context.test_real_model import MAX_TOKENS, server
from tests.daemon import Daemon, daemons, events
from tests.http.test_live_output_daemon import messages
from tests.model_server import ModelServer

__all__ = ["daemons", "server"]  # the fixtures

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(300)


def test_a_real_servers_answer_streams_to_the_attached_client(
    daemons: Daemons, server: ModelServer
) -> None:
    model = {
        "provider": "openai",
        "base_url": server.base_url,
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "timeout": 60,
    }
    daemon = daemons(agent={"class": "workers.agents.tool_loop:ToolLoopAgent"}, model=model)
    daemon.start()
    with daemon.client() as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        with client.stream("GET", f"/v1/sessions/{sid}/attach", timeout=120) as stream:
            sent = client.post(f"/v1/sessions/{sid}/inject", json={"text": "tell me a story"})
            assert sent.status_code == 202, sent.text
            got: list[dict[str, Any]] = []
            for message in messages(stream.iter_lines()):
                got.append(message)
                if message["event"] == "turn_ended":
                    break
    assert got[-1]["data"]["payload"]["outcome"] == "completed", got[-1]
    deltas = [m for m in got if m["event"] == "delta"]
    assert deltas, got  # before turn_ended: the loop stopped there
    assert all(m["id"] is None for m in deltas)
    assert [d["data"]["index"] for d in deltas] == list(range(len(deltas)))
    with Store(daemon.url, migrate=False) as store:
        [answer] = [e for e in events(store, sid) if e.type == "model_response"]
    assert answer.payload["text"]
    assert "".join(d["data"]["text"] for d in deltas) == answer.payload["text"]
