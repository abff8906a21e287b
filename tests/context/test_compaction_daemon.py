"""Sessions that outlive the model's context window (issue 29), against a real daemon
and the `echo` model, which is a server with the window `model.context_window` names
(a prompt that passes it fails as a real server's does): every turn completes, the older
turns are compacted, the API, the CLI and /metrics show it, and a SIGKILL during a
compaction leaves it to be redone once."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, events, turn_ended, turnkeeper, wait_until

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)

WINDOW, MAX_TOKENS = 400, 64
MODEL = {"context_window": WINDOW, "max_tokens": MAX_TOKENS, "context_margin": 16}


def sample(metrics: str, name: str) -> float:
    found = [line for line in metrics.splitlines() if line.startswith(f"{name} ")]
    return float(found[0].split()[-1]) if found else 0.0


def turn(daemon: Daemon, store: Store, session: str, text: str) -> dict[str, Any]:
    """Send `text`; the `turn_ended` payload of the turn that answered it."""
    with daemon.client() as api:
        seq = api.post(f"/v1/sessions/{session}/inject", json={"text": text}).json()["seq"]
    ended = wait_until(lambda: turn_ended(store, session, seq), 60, f"the turn for {text!r}")
    return ended.payload


def test_fifty_turns_on_a_small_window_all_complete_with_compactions(daemons: Daemons) -> None:
    daemon = daemons(model=MODEL).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "long"}).json()["id"]
        for index in range(50):
            text = "/big 30" if index % 2 else f"message {index}: tell me more about it"
            assert turn(daemon, store, session, text)["outcome"] == "completed", index
        log = events(store, session)
        compactions = [e.payload for e in log if e.type == "compaction"]
        answers = [e.payload for e in log if e.type == "model_response"]
        # Echo refuses any prompt past its window: every answer is one that fit.
        assert len(answers) == 50
        assert all(a["usage"]["prompt_tokens"] + MAX_TOKENS <= WINDOW for a in answers)
        assert len(compactions) >= 3
        assert len({c["to_seq"] for c in compactions}) == len(compactions)  # never twice
        for compaction in compactions:
            assert compaction["method"] == "summary"
            assert compaction["tokens_after"] < compaction["tokens_before"]
        shown = api.get(f"/v1/sessions/{session}").json()["context"]
        assert shown["window"] == WINDOW and shown["compactions"] == len(compactions)
        assert 0 < shown["last_prompt_tokens"] <= WINDOW - MAX_TOKENS
        assert shown["last_compaction"]["to_seq"] == compactions[-1]["to_seq"]
        metrics = api.get("/metrics").text
        assert sample(metrics, "turnkeeper_compactions_total") == len(compactions)
    printed = turnkeeper(daemon, "sessions", "show", session)
    assert printed.returncode == 0, printed.stderr
    assert f"/ {WINDOW} tokens in the last prompt" in printed.stdout
    assert f"{len(compactions)} compactions, the last" in printed.stdout


def test_a_sigkill_during_a_compaction_leaves_it_to_be_redone_once(
    daemons: Daemons, tmp_path: Path
) -> None:
    # The summarizing call sleeps: the daemon is killed while it is under way.
    daemon = daemons(model={**MODEL, "compaction_prompt": "/sleep 600 the summary"}).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "killed"}).json()["id"]
        index = 0
        while "compacting the conversation" not in daemon.log():
            with daemon.client() as api2:
                seq = api2.post(
                    f"/v1/sessions/{session}/inject", json={"text": f"/big {20 + index}"}
                ).json()["seq"]
            wait_until(
                lambda s=seq: (
                    turn_ended(store, session, s) or "compacting the conversation" in daemon.log()
                ),
                60,
                "the turn to end or to compact",
            )
            index += 1
            assert index < 40, "no compaction began"
        held = seq
        assert turn_ended(store, session, held) is None
        assert not [e for e in events(store, session) if e.type == "compaction"]
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        daemon.kill_everything()

        # Restarted with a prompt that answers at once: the turn is continued, and its
        # compaction is made again, once.
        daemon.config["model"]["compaction_prompt"] = "sum it up"
        daemon.config_path.write_text(__import__("tomli_w").dumps(daemon.config))
        daemon.start()
        ended = wait_until(lambda: turn_ended(store, session, held), 90, "the held turn")
        assert ended.payload["outcome"] == "completed"
        log = events(store, session)
        compactions = [e for e in log if e.type == "compaction"]
        assert len(compactions) == 1
        assert compactions[0].payload["summary"] == "echo: sum it up"
        assert any(e.type == "continuation" and e.seq > held for e in log)

        # A replay: the whole log is still there, over the API, seq after seq.
        with daemon.client() as api3:
            replayed = api3.get(f"/v1/sessions/{session}/events", params={"limit": 1000}).json()
        seqs = [e["seq"] for e in replayed["events"]]
        assert seqs == list(range(1, len(log) + 1))
        # And the next turn builds on the compaction: its prompt is far smaller than the
        # log behind it.
        assert turn(daemon, store, session, "and now?")["outcome"] == "completed"
        last = [e for e in events(store, session) if e.type == "model_response"][-1]
        assert last.payload["usage"]["prompt_tokens"] + MAX_TOKENS <= WINDOW
