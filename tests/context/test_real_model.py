"""Long sessions against a real OpenAI-compatible server (issue 29): llama-cpp-python's,
with a tiny random-weight model and a 1,024-token window (`tests/model_server.py`). A
session of 50 turns completes every turn, its older turns compacted, whether the window
is configured or learned from the server's first context-length error."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, events, turn_ended, turnkeeper, wait_until
from tests.model_server import ModelServer, require

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(300)
N_CTX, MAX_TOKENS = 1024, 64


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ModelServer]:
    require()
    started = ModelServer(tmp_path / "model", N_CTX).start()
    try:
        yield started
    finally:
        started.stop()


def model_config(server: ModelServer, window: int) -> dict[str, object]:
    return {
        "provider": "openai",
        "base_url": server.base_url,
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "context_window": window,
        "timeout": 60,
        # llama-cpp-python's server counts no tokens in a stream: these tests check the
        # prompts against the server's own counts, which come with whole answers only.
        "stream": False,
    }


@pytest.mark.parametrize("window", [N_CTX, 0], ids=["configured", "learned"])
def test_fifty_turns_on_a_1024_token_window_all_complete(
    daemons: Daemons, server: ModelServer, window: int
) -> None:
    daemon = daemons(model=model_config(server, window)).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "long"}).json()["id"]
        for index in range(50):
            text = f"message {index}: the weather, the news and a question about it"
            seq = api.post(f"/v1/sessions/{session}/inject", json={"text": text}).json()["seq"]
            ended = wait_until(lambda s=seq: turn_ended(store, session, s), 120, f"turn {index}")
            assert ended.payload["outcome"] == "completed", (index, ended.payload)
        log = events(store, session)
        compactions = [e.payload for e in log if e.type == "compaction"]
        assert len(compactions) >= 2
        assert {c["window"] for c in compactions} == {N_CTX}
        answers = [e.payload for e in log if e.type == "model_response"]
        assert len(answers) >= 50
        # The server counted every prompt it answered: each fit its window.
        assert all(a["usage"]["prompt_tokens"] + MAX_TOKENS <= N_CTX for a in answers)
        shown = api.get(f"/v1/sessions/{session}").json()["context"]
        assert shown["window"] == N_CTX and shown["compactions"] == len(compactions)
    if window == 0:  # learned from the server's error: the first compaction was forced
        assert f"did not fit the context window ({N_CTX})" in daemon.log()


@pytest.mark.slow
def test_a_model_server_stopped_for_a_minute_during_a_turn(
    daemons: Daemons, server: ModelServer
) -> None:
    daemon = daemons(model=model_config(server, N_CTX)).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "outage"}).json()["id"]
        seq = api.post(f"/v1/sessions/{session}/inject", json={"text": "hello"}).json()["seq"]
        wait_until(lambda: turn_ended(store, session, seq), 60, "the first turn")
        server.stop()
        stopped = time.monotonic()
        seq = api.post(f"/v1/sessions/{session}/inject", json={"text": "are you there?"}).json()[
            "seq"
        ]
        notices = lambda: [  # noqa: E731
            e for e in events(store, session) if e.seq > seq and e.type == "notice"
        ]
        wait_until(notices, 60, "the outage's notice")
        assert notices()[0].payload["text"] == "the model is unavailable; retrying"
        # The daemon is fine and says the model is not.
        wait_until(lambda: daemon.status()["model"]["state"] == "unavailable", 30, "the state")
        assert api.get("/readyz").status_code == 200
        assert "turnkeeper_model_up 0.0" in api.get("/metrics").text
        shown = turnkeeper(daemon, "status")
        assert "model UNAVAILABLE since" in shown.stdout, shown.stdout + shown.stderr
        time.sleep(max(0.0, 60 - (time.monotonic() - stopped)))  # down for a minute
        assert turn_ended(store, session, seq) is None
        server.start()
        ended = wait_until(lambda: turn_ended(store, session, seq), 90, "the turn after it")
        assert ended.payload["outcome"] == "completed"
        after = [e for e in events(store, session) if e.seq > seq]
        assert len(notices()) == 1
        assert [e.type for e in after].count("turn_started") == 1
        assert not [e for e in after if e.type == "continuation"]  # no attempt spent
        wait_until(lambda: daemon.status()["model"]["state"] == "ok", 30, "the model ok again")
        assert "turnkeeper_model_up 1.0" in api.get("/metrics").text


def test_a_turn_budget_cuts_a_turn_on_a_real_server(daemons: Daemons, server: ModelServer) -> None:
    # 300 tokens a turn: the first prompts fit; the session's prompt grows past it.
    daemon = daemons(model=model_config(server, N_CTX), budget={"turn_tokens": 300}).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "budget"}).json()["id"]
        outcomes = []
        for index in range(20):
            text = f"message {index}: the weather, the news and a question about it"
            seq = api.post(f"/v1/sessions/{session}/inject", json={"text": text}).json()["seq"]
            ended = wait_until(lambda s=seq: turn_ended(store, session, s), 120, f"turn {index}")
            outcomes.append(ended.payload["outcome"])
            if ended.payload["outcome"] == "budget_exhausted":
                break
        assert outcomes[0] == "completed" and outcomes[-1] == "budget_exhausted", outcomes
        assert "budget.turn_tokens (300)" in ended.payload["error"]
        spent = [
            e.payload["tokens"]["turn"] for e in events(store, session) if e.type == "turn_ended"
        ]
        assert all(0 < t <= 300 for t in spent[:-1])
