"""MCP children and the bounded teardown, with the daemon and real MCP servers."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from supervisor.contract.config import Config
from supervisor.store import Store
from supervisor.teardown import teardown_budget
from tests.conftest import REPO, python_env
from tests.daemon import Daemon, daemons, events, inject, turn_ended, wait_until

__all__ = ["daemons"]
Daemons = Callable[..., Daemon]


def server(name: str, module: str, *args: str, **env: str) -> dict[str, Any]:
    return {
        "name": name,
        "command": [sys.executable, "-m", f"tests.mcp_servers.{module}", *args],
        "start_timeout": 90.0,
        "call_timeout": 20.0,
        "env": env,
    }


def mcp_children(daemon: Daemon) -> list[int]:
    with Store(daemon.url, migrate=False) as store:
        boot = store.boots.recent(1)[0].boot_id
        return [c.pid for c in store.children.of_boot(boot) if c.kind == "mcp"]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pids_in(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.timeout(120)
def test_a_turn_calls_a_real_mcp_server_and_survives_its_death(daemons: Daemons) -> None:
    daemon = daemons(
        pool={"workers": 1, "spare": 0}, mcp={"servers": [server("calc", "basic")]}
    ).start()
    with Store(daemon.url, migrate=False) as store:
        sid = store.sessions.create("test").id
        seq = inject(store, sid, '/tool add {"a": 2, "b": 3}')
        ended = wait_until(lambda: turn_ended(store, sid, seq), 60, "the tool turn")
        turn = [e for e in events(store, sid) if e.turn_id == ended.turn_id]
        kinds = [e.type for e in turn]
        assert kinds == [
            "turn_started",
            "model_response",
            "tool_call",
            "tool_result",
            "model_response",
            "turn_ended",
        ]
        assert turn[3].payload["content"] == "5" and not turn[3].payload["is_error"]
        assert turn[4].payload["text"] == "echo: 5"
        first_server = mcp_children(daemon)
        # The server dies in the middle of a call: the turn gets an error result and ends.
        seq = inject(store, sid, "/tool die {}")
        ended = wait_until(lambda: turn_ended(store, sid, seq), 60, "the turn whose tool died")
        assert ended.payload["outcome"] == "completed"
        result = next(e for e in events(store, sid) if e.seq > seq and e.type == "tool_result")
        assert result.payload["is_error"]
        # It was restarted: the next call works, in a new process.
        seq = inject(store, sid, '/tool add {"a": 1, "b": 1}')
        wait_until(lambda: turn_ended(store, sid, seq), 60, "a call after the restart")
        result = next(e for e in events(store, sid) if e.seq > seq and e.type == "tool_result")
        assert result.payload["content"] == "2"
        assert set(mcp_children(daemon)) - set(first_server), "no new server process"


@pytest.mark.timeout(240)
def test_teardown_of_4x4_stubborn_children_is_bounded_and_complete(
    daemons: Daemons, tmp_path: Path
) -> None:
    # tiny MCP servers (no SDK: they start in milliseconds); what is tested is processes.
    escaped = tmp_path / "escaped.pids"
    servers = [server(f"stubborn{i}", "tiny", "--ignore-term") for i in range(3)]
    servers.append(server("spawner", "tiny", "--ignore-term", "--spawn-escaped", str(escaped)))
    grace = 2.0
    daemon = daemons(
        pool={"workers": 4, "spare": 0}, mcp={"servers": servers}, shutdown={"kill_grace": grace}
    ).start()
    wait_until(
        lambda: len([p for p in mcp_children(daemon) if alive(p)]) == 16, 180, "16 MCP servers"
    )
    wait_until(lambda: len(pids_in(escaped)) == 4, 30, "the spawners' grandchildren")
    tree = [p.pid for p in psutil.Process(daemon.pid).children(recursive=True)]
    tree += pids_in(escaped)
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(grace + 10) == 0
    took = time.monotonic() - started
    assert took <= grace + 1.0, f"teardown took {took:.2f} s"
    leftovers = [pid for pid in tree if alive(pid)]
    assert leftovers == [], f"processes outlived the daemon: {leftovers}"
    assert daemon.log().count("still running at the deadline; SIGKILL to its group") >= 12


@pytest.mark.timeout(240)
def test_teardown_of_well_behaved_children_needs_no_sigkill(daemons: Daemons) -> None:
    servers = [server(f"tiny{i}", "tiny") for i in range(4)]
    daemon = daemons(pool={"workers": 4, "spare": 0}, mcp={"servers": servers}).start()
    wait_until(
        lambda: len([p for p in mcp_children(daemon) if alive(p)]) == 16, 180, "16 MCP servers"
    )
    tree = [p.pid for p in psutil.Process(daemon.pid).children(recursive=True)]
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(20) == 0
    took = time.monotonic() - started
    assert [pid for pid in tree if alive(pid)] == []
    # Nobody waited for the grace: every process exited on SIGTERM.
    assert re.search(
        r"processes stopped in [\d.]+ s: \d+ exited on SIGTERM, 0 needed SIGKILL", daemon.log()
    ), daemon.log()[-2000:]
    print(f"well-behaved teardown: {took:.2f} s")


# A step cut at its cap ends a moment after it: the timer's wake-up and the cancellation.
CUT_SLACK = 0.25
STEP_LINE = re.compile(r"\[shutdown\] (.+?) done in ([\d.]+) s \(cap ([\d.]+) s\)$", re.M)


@pytest.mark.timeout(180)
def test_a_real_stop_keeps_within_the_teardown_budget_step_by_step(
    daemons: Daemons, tmp_path: Path
) -> None:
    """Every capped step of a stop runs: the drain and the subagent drain to their caps (a
    subagent's turn held in flight), the descendants with a worker and its MCP server (one
    that ignores SIGTERM). Each is counted in the budget at the cap it ran with and took no
    longer, and so is the whole stop."""
    daemon = daemons(
        pool={"workers": 1, "spare": 0},
        mcp={"servers": [server("stubborn", "tiny", "--ignore-term")]},
        shutdown={"kill_grace": 1.0, "drain_budget": 1.0, "subagent_drain": 1.0},
        attach={"shutdown_timeout": 1.0},
    )
    with Store(daemon.url) as store:
        parent = store.sessions.create("test").id
        held = f"/gate {tmp_path / 'never'} held"
        child = store.subagents.spawn(
            parent, held, token=0, turn_id=None, max_depth=2, max_children=8
        ).child.id
    daemon.start()
    with Store(daemon.url, migrate=False) as store:
        wait_until(lambda: store.sessions.get(child).active_turn_id, 60, "the subagent's turn")
    wait_until(lambda: any(alive(p) for p in mcp_children(daemon)), 60, "the MCP server")
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    took = time.monotonic() - started
    log = daemon.log()

    budget = teardown_budget(Config.model_validate(daemon.config))
    ran = {m[1]: (float(m[2]), float(m[3])) for m in STEP_LINE.finditer(log)}
    assert set(ran) == {
        "drain",
        "http listener",
        "subagent drain",
        "descendants",
        "peer deregistration",
        "boot row",
    }, log
    for name, (seconds, cap) in ran.items():
        assert cap == budget.seconds(name), f"{name} ran with a cap of {cap:g} s"
        assert seconds <= cap + CUT_SLACK, f"{name} took {seconds:.2f} s"
    assert ran["drain"][0] >= 1.0 and ran["subagent drain"][0] >= 1.0  # both to their caps
    # The boot row keeps the durations of the steps before its own, for the next boot.
    with Store(daemon.url, migrate=False) as store:
        kept = store.boots.recent(1)[0].breaker["shutdown_steps"]
    assert set(kept) == set(ran) - {"boot row"}
    assert all(abs(kept[name] - ran[name][0]) < 0.01 for name in kept), (kept, ran)
    stopped = re.search(r"stopped cleanly in ([\d.]+) s", log)
    assert stopped is not None and float(stopped[1]) <= budget.total
    assert took < budget.total, f"the stop took {took:.2f} s of a budget of {budget.total:g} s"


@pytest.mark.timeout(240)
def test_sigkill_of_the_supervisor_takes_every_mcp_child_with_it(daemons: Daemons) -> None:
    servers = [server("calc", "tiny"), server("stubborn", "tiny", "--ignore-term")]
    daemon = daemons(pool={"workers": 2, "spare": 0}, mcp={"servers": servers}).start()
    wait_until(
        lambda: len([p for p in mcp_children(daemon) if alive(p)]) == 4, 120, "4 MCP servers"
    )
    children = mcp_children(daemon)
    daemon.signal(signal.SIGKILL)
    daemon.wait(10)
    wait_until(
        lambda: not any(alive(p) for p in children),
        2.0,
        "every MCP child to die with the supervisor",
    )


@pytest.mark.timeout(120)
def test_the_boot_sweep_kills_leftovers_but_not_a_reused_pid(daemons: Daemons) -> None:
    daemon = daemons(pool={"workers": 1, "spare": 0})
    sleeper = "import time; time.sleep(600)"
    leftover = subprocess.Popen([sys.executable, "-c", sleeper])
    stranger = subprocess.Popen([sys.executable, "-c", sleeper])
    try:
        created = psutil.Process(leftover.pid).create_time()
        with Store(daemon.url) as store:
            store.children.record("an-earlier-boot", leftover.pid, created, "mcp")
            # The stranger merely has a pid an earlier boot once recorded: another start time.
            store.children.record("an-earlier-boot", stranger.pid, created - 1000.0, "mcp")
        daemon.start()
        assert leftover.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None, "a process that only reuses a pid was killed"
        assert "swept 2 processes of earlier boots: 1 killed, 0 gone, 1 pid reused" in daemon.log()
        with Store(daemon.url, migrate=False) as store:
            assert store.children.of_other_boots(store.boots.recent(1)[0].boot_id) == []
    finally:
        for proc in (leftover, stranger):
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_sigterm_with_20_turns_in_flight_and_a_client_injecting(
    daemons: Daemons, tmp_path: Path
) -> None:
    socket = tmp_path / "api.sock"
    # All 20 interrupted sessions are continued by the boot scan (10 a pass by default).
    daemon = daemons(http={"listen": f"unix:{socket}"}, recovery={"max_per_pass": 20}).start()
    client = daemon.client()
    sessions = [client.post("/v1/sessions", json={}).json()["id"] for _ in range(20)]
    gate = tmp_path / "gate"  # the turns are held in flight until the daemon has stopped
    for sid in sessions:
        assert (
            client.post(f"/v1/sessions/{sid}/inject", json={"text": f"/gate {gate} slow"})
        ).status_code == 202
    answers: list[tuple[str, str, int | str]] = []
    stop = threading.Event()

    def inject_forever() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            sid, text = sessions[n % 20], f"late {n}"
            try:
                reply = client.post(
                    f"/v1/sessions/{sid}/inject",
                    json={"text": text},
                    headers={"Idempotency-Key": f"late-{n}"},
                )
                answers.append((sid, text, reply.status_code))
            except httpx.TransportError as exc:
                answers.append((sid, text, type(exc).__name__))
                time.sleep(0.01)

    with Store(daemon.url, migrate=False) as store:
        wait_until(
            lambda: sum(1 for s in sessions if store.sessions.get(s).active_turn_id) >= 15,
            30,
            "turns in flight",
        )
        sender = threading.Thread(target=inject_forever)
        sender.start()
        try:
            time.sleep(0.3)
            in_flight = [s for s in sessions if store.sessions.get(s).active_turn_id]
            daemon.signal(signal.SIGTERM)
            assert daemon.wait(30) == 0
            time.sleep(0.2)
        finally:
            stop.set()
            sender.join(10)
            client.close()
        interrupted = [s for s in in_flight if store.sessions.get(s).active_turn_id]
        assert len(interrupted) >= 10, "the stop did not interrupt turns in flight"
        gate.touch()
        daemon.start()
        for sid in interrupted:
            wait_until(
                lambda sid=sid: (
                    store.sessions.get(sid).active_turn_id is None
                    and not store.sessions.get(sid).pending
                ),
                60,
                "the turns to finish",
            )
            found = events(store, sid)
            first = next(e for e in found if e.type == "turn_started")
            ends = [e for e in found if e.type == "turn_ended" and e.turn_id == first.turn_id]
            notes = [e for e in found if e.type == "continuation"]
            queued = any(
                e.type == "user_message" and first.seq < e.seq < ends[0].seq for e in found
            )
            if queued:
                # A message that arrived during the turn drives the next turn, with no note.
                assert [e.payload["outcome"] for e in ends] == ["interrupted"]
                assert not [n for n in notes if n.turn_id == first.turn_id]
                last = [e for e in found if e.type == "turn_ended"][-1]
                assert last.turn_id != first.turn_id and last.payload["outcome"] == "completed"
            else:
                assert [e.payload["outcome"] for e in ends] == ["completed"]
                assert notes and notes[0].payload["cause"] == "daemon_restart"
            assert not [e for e in found if e.type == "notice"], "nobody was asked to resend"
        accepted = {(sid, text) for sid, text, status in answers if status == 202}
        stored = {
            (sid, e.payload["text"])
            for sid in sessions
            for e in events(store, sid)
            if e.type == "user_message"
        }
        assert accepted <= stored, f"{len(accepted - stored)} acknowledged messages lost"
        assert all(status in (202, 503) or isinstance(status, str) for _, _, status in answers)


@pytest.mark.timeout(120)
def test_stop_with_drain_lets_the_turn_in_flight_finish(daemons: Daemons, tmp_path: Path) -> None:
    socket = tmp_path / "api.sock"
    daemon = daemons(http={"listen": f"unix:{socket}"}).start()
    client = daemon.client()
    sid = client.post("/v1/sessions", json={}).json()["id"]
    gate = tmp_path / "gate"  # the turn is held in flight until the drain has begun
    assert (
        client.post(f"/v1/sessions/{sid}/inject", json={"text": f"/gate {gate} drained"})
    ).status_code == 202
    with Store(daemon.url, migrate=False) as store:
        wait_until(lambda: store.sessions.get(sid).active_turn_id, 20, "the turn to start")
        stop = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "supervisor",
                "--config",
                str(daemon.config_path),
                "stop",
                "--drain=20",
            ],
            cwd=REPO,
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: "draining" in daemon.log(), 20, "the drain to begin")
        refused = client.post(f"/v1/sessions/{sid}/inject", json={"text": "too late"})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        gate.touch()  # the turn may finish now, and the drain with it
        _, err = stop.communicate(timeout=60)
        assert stop.returncode == 0, err
        assert daemon.wait(10) == 0
        ended = turn_ended(store, sid)
        assert ended is not None and ended.payload["outcome"] == "completed"
        texts = [e.payload.get("text") for e in events(store, sid)]
        assert f"echo: /gate {gate} drained" in texts and "too late" not in texts
        assert store.sessions.get(sid).active_turn_id is None
    client.close()
    assert re.search(r"drain done in [\d.]+ s", daemon.log())
