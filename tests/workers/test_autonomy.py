"""Autonomous runs: the budget rules (pure), and a run SIGKILLed mid-turn (real daemon)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.autonomy import Run, progress, run_of, unfinished
from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, daemons, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
NOW = 1_000.0
RUN = Run("win", "go on", max_turns=3, max_tokens=100, deadline_at=NOW + 60)


@dataclass(frozen=True)
class Ev:
    seq: int
    type: str
    payload: dict[str, Any] = field(default_factory=dict)


def log(*steps: tuple[str, dict[str, Any]]) -> list[Ev]:
    first = [("checkpoint", RUN.start_payload(NOW)), ("user_message", {"text": "win"})]
    return [Ev(i + 1, t, p) for i, (t, p) in enumerate([*first, *steps])]


def answer(text: str = "echo: x", tokens: int = 10) -> tuple[str, dict[str, Any]]:
    usage = {"prompt_tokens": tokens // 2, "completion_tokens": tokens - tokens // 2}
    return ("model_response", {"text": text, "tool_calls": [], "usage": usage})


ENDED = ("turn_ended", {"outcome": "completed"})
FAILED = ("turn_ended", {"outcome": "failed"})


@pytest.mark.parametrize(
    ("steps", "now", "turns", "tokens", "stop"),
    [
        ([answer(), ENDED], NOW, 1, 10, None),
        ([answer(), ENDED, answer(), ENDED], NOW, 2, 20, None),
        ([answer(), ENDED, answer(), ENDED, answer(), ENDED], NOW, 3, 30, "max_turns"),
        ([answer(tokens=60), ENDED, answer(tokens=40), ENDED], NOW, 2, 100, "max_tokens"),
        ([answer(), ENDED], NOW + 60, 1, 10, "deadline"),
        ([answer(), ENDED], NOW + 59.9, 1, 10, None),
        ([answer("done. [Goal met]"), ENDED], NOW, 1, 10, "goal_met"),
        ([answer(), FAILED], NOW, 1, 10, "failed"),
        # A turn continued after a crash counts once; the answer the crash cut short
        # still spent its tokens.
        ([answer(tokens=30), ("continuation", {}), answer(), ENDED], NOW, 1, 40, None),
        # An earlier checkpoint's counters are recounted, never carried.
        ([answer(), ENDED, ("checkpoint", {"turns": 0, "tokens": 0})], NOW, 1, 10, None),
    ],
)
def test_progress(
    steps: list[tuple[str, dict[str, Any]]], now: float, turns: int, tokens: int, stop: str | None
) -> None:
    got = progress(log(*steps), now)
    assert got == {
        "goal": "win",
        "budgets": {"max_turns": 3, "max_tokens": 100, "deadline_at": NOW + 60},
        "turns": turns,
        "tokens": tokens,
        "stop_reason": stop,
        "next_wake_at": None if stop else now,
        "prompt": "go on",
    }


def test_progress_counts_on_from_the_newest_checkpoint_alone() -> None:
    """A compaction lets the worker's log start after the run's first checkpoint: each
    checkpoint sets the run out again, and its counters are where the count goes on."""
    events = log(answer(), ENDED)
    first = progress(events, NOW)
    assert first is not None
    tail = [
        Ev(10, "checkpoint", first),
        *(
            Ev(11 + i, t, p)
            for i, (t, p) in enumerate(
                [("user_message", {"text": "go on"}), answer(tokens=80), ENDED]
            )
        ),
    ]
    second = progress(tail, NOW)
    assert second is not None
    assert (second["turns"], second["tokens"], second["stop_reason"]) == (2, 90, None)
    third = progress([*tail, Ev(20, "checkpoint", second), Ev(21, *answer()), Ev(22, *ENDED)], NOW)
    assert third is not None
    assert (third["turns"], third["tokens"], third["stop_reason"]) == (3, 100, "max_turns")


def test_a_session_without_a_run() -> None:
    plain = [Ev(1, "user_message", {"text": "hi"})]
    assert progress(plain, NOW) is None and run_of(plain) is None and not unfinished(plain)


def test_unfinished_reads_the_newest_checkpoint() -> None:
    events = log(answer(), ENDED)
    assert unfinished(events)
    stopped = [*events, Ev(len(events) + 1, "checkpoint", {"stop_reason": "max_turns"})]
    assert not unfinished(stopped)


def checkpoints(store: Store, session_id: str) -> list[dict[str, Any]]:
    found = store.events.read(session_id, limit=100_000)
    return [e.payload for e in found if e.type == "checkpoint"]


@pytest.mark.timeout(180)
def test_an_autonomous_run_sigkilled_mid_turn_resumes_and_stops_at_its_budget(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(http={"listen": f"unix:{tmp_path / 'api.sock'}"}).start()
    with Store(daemon.url, migrate=False) as store:
        with daemon.client() as client:
            created = client.post(
                "/v1/sessions",
                json={
                    "kind": "autonomous",
                    "run": {"goal": "/sleep 1 work", "prompt": "/sleep 1 more", "max_turns": 6},
                },
            )
            assert created.status_code == 201, created.text
            sid = created.json()["id"]

        def mid_turn_after_two() -> bool:
            done = checkpoints(store, sid)
            return len(done) >= 3 and store.sessions.get(sid).active_turn_id is not None

        wait_until(mid_turn_after_two, 30, "two turns done and the third running")
        daemon.signal(signal.SIGKILL)
        daemon.wait(10)
        before = checkpoints(store, sid)[-1]
        assert before["turns"] == 2 and before["stop_reason"] is None

        daemon.start()  # nothing touches the session: the run goes on by itself

        def stopped() -> dict[str, Any] | None:
            last = checkpoints(store, sid)[-1]
            return last if last["stop_reason"] else None

        last = wait_until(stopped, 60, "the run to stop at its budget")
        assert last["stop_reason"] == "max_turns" and last["turns"] == 6
        time.sleep(1.5)  # and it stays stopped
        found = store.events.read(sid, limit=100_000)
        assert [e.seq for e in found] == list(range(1, len(found) + 1))
        assert [e.type for e in found].count("turn_ended") == 6
        assert [e.type for e in found].count("turn_started") == 6
        notes = [e for e in found if e.type == "continuation"]
        assert len(notes) == 1 and notes[0].payload["cause"] == "daemon_restart"
        counted = [c["turns"] for c in checkpoints(store, sid)[1:]]
        assert counted == sorted(counted) and counted[-1] == 6, counted  # never reset
        tokens = [c["tokens"] for c in checkpoints(store, sid)[1:]]
        assert tokens == sorted(tokens) and tokens[-1] > 0
        assert store.sessions.get(sid).active_turn_id is None
        assert "[recovery]" in daemon.log()


def between_turns(store: Store, max_turns: int) -> str:
    """An autonomous run whose first turn ended and was checkpointed, and whose next
    prompt was never written (the daemon died in between)."""
    run = Run("/sleep 0.2 work", "/sleep 0.2 more", max_turns, None, None)
    sid = store.sessions.create(
        "admin",
        kind="autonomous",
        events=[("checkpoint", run.start_payload(time.time())), ("user_message", {"text": "x"})],
    ).id
    lease = store.leases.acquire(sid, "gone/boot/w0.1", 30)
    assert lease is not None
    read = store.events.read(sid)[-1].seq
    store.events.append(sid, "turn_started", {"read_to": read}, token=lease.token, turn_id="t1")
    store.events.append(
        sid, "turn_ended", {"outcome": "completed"}, token=lease.token, turn_id="t1"
    )
    payload = progress(store.events.read(sid), time.time())
    assert payload is not None  # stopped already when max_turns is 1
    store.events.append(sid, "checkpoint", payload, token=lease.token)
    store.leases.release(lease)
    return sid


@pytest.mark.timeout(120)
def test_a_run_stopped_between_turns_is_resumed_by_the_boot_scan(daemons: Daemons) -> None:
    daemon = daemons()
    daemon.state.mkdir(parents=True)
    with Store(daemon.url) as store:
        sid = between_turns(store, max_turns=3)
    daemon.start()
    with Store(daemon.url, migrate=False) as store:
        wait_until(lambda: checkpoints(store, sid)[-1]["stop_reason"] == "max_turns", 30, "the run")
        assert checkpoints(store, sid)[-1]["turns"] == 3
        resumed = [e for e in store.events.read(sid) if e.payload.get("resumed")]
        assert len(resumed) == 1 and resumed[0].writer == "supervisor"
    assert re.search(r"\[recovery\].*autonomous run resumed after 1 turns", daemon.log())


def test_autonomous_resume_writes_the_prompt_once_and_leaves_stopped_runs(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = python_env(TURNKEEPER_DAEMON__STATE_DIR=str(state), TURNKEEPER_CONFIG="")
    state.mkdir()
    with Store(f"sqlite:///{state / 'turnkeeper.db'}") as store:
        sid = between_turns(store, max_turns=1)  # its only turn is done: stopped
        other = between_turns(store, max_turns=5)

    def resume(*args: str) -> str:
        done = subprocess.run(
            [PYTHON, "-m", "supervisor", "autonomous", "resume", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert "resumed after 1 turns" in resume(other)
    assert "has a turn in flight or waiting" in resume(other)  # not twice
    out = resume()
    assert f"{sid}: stopped (max_turns)" in out and "0 runs resumed" in out
    runs = {run["id"]: run for run in json.loads(resume("--json"))["runs"]}
    assert runs[sid]["result"] == "stopped", runs
    assert json.loads(resume(other, "--json"))["runs"][0]["result"] == "busy"
