"""The control plane against what a local process may send: a real daemon, driven from
outside (its control socket, HTTP, its log and files).

`MisbehavingAgent` is the agent plug-in of the tests that need a genuine worker to send
something wrong; imported by a daemon's main process (its launcher) whose environment
names a marker file in SABOTAGE, this module also makes the pool's housekeeping task die
once that file exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import multiprocess
import psutil
import pytest
import zmq

from supervisor.contract.control import (
    MAX_NAME,
    MAX_SEQ,
    MAX_SERVERS,
    Heartbeat,
    ProtocolError,
    Refusals,
    decode,
)
from supervisor.contract.control import WORKER_MESSAGES as WORKERS
from supervisor.store import Store
from tests.conftest import PYTHON
from tests.daemon import Daemon, daemons, wait_until
from workers.agent import Turn
from workers.agents.tool_loop import ToolLoopAgent

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
AGENT = "tests.security.test_control:MisbehavingAgent"
SABOTAGE = "TURNKEEPER_TEST_SABOTAGE"
LATENCY = {"counts": [0] * 12, "sum": 0.0}


class MisbehavingAgent(ToolLoopAgent):
    """`/send-once PATH JSON`: unless PATH exists, create it and send JSON (speaking as
    this worker) over the worker's own control socket, and give the supervisor 10 s to
    replace the worker. Otherwise (or if it is still alive) it answers like the tool-loop
    agent."""

    async def run_turn(self, turn: Turn) -> str:
        users = [m.content for m in turn.messages if m.role == "user" and not m.note]
        if users and users[-1].startswith("/send-once "):
            _, path, frame = users[-1].split(" ", 2)
            if not Path(path).exists():
                Path(path).touch()
                from workers.main import Worker

                worker = next(o for o in gc.get_objects() if isinstance(o, Worker))
                message = {"worker": worker.spec.identity, **json.loads(frame)}
                await worker.socket.send(json.dumps(message).encode())
                await asyncio.sleep(10.0)  # the supervisor kills this worker meanwhile
        return await super().run_turn(turn)


def _sabotage(marker: Path) -> None:
    """In the daemon: the control plane's receive loop dies once `marker` exists."""
    from supervisor.pool.plane import ControlPlane

    receive = ControlPlane.receive

    async def sabotaged(plane: ControlPlane) -> None:
        served = asyncio.ensure_future(receive(plane))
        try:
            while not marker.exists():
                await asyncio.sleep(0.05)
            raise RuntimeError("sabotaged by the test")
        finally:
            served.cancel()

    ControlPlane.receive = sabotaged  # type: ignore[method-assign]


if os.environ.get(SABOTAGE) and multiprocess.current_process().name == "MainProcess":
    _sabotage(Path(os.environ[SABOTAGE]))


# --- helpers --------------------------------------------------------------------------


class Peer:
    """A local process on the control socket: a DEALER, with `identity` if given."""

    def __init__(self, context: zmq.Context[Any], daemon: Daemon, identity: bytes | None) -> None:
        self.socket = context.socket(zmq.DEALER)
        if identity is not None:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"ipc://{daemon.root / 'run' / 'control.sock'}")

    def send(self, *frames: bytes | dict[str, Any]) -> None:
        self.socket.send_multipart(
            [f if isinstance(f, bytes) else json.dumps(f).encode() for f in frames]
        )

    def received(self) -> bool:
        return bool(self.socket.poll(0))


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def api(tmp_path: Path) -> dict[str, str]:
    return {"listen": f"unix:{tmp_path}/api.sock"}


def turn(client: httpx.Client, text: str, session: str | None = None) -> str:
    """Send `text` to a session (a new one if None) and wait for its turn to end."""
    if session is None:
        session = client.post("/v1/sessions", json={}).json()["id"]
    sent = client.post(f"/v1/sessions/{session}/inject", json={"text": text})
    assert sent.status_code == 202, sent.text
    seq = sent.json()["seq"]

    def ended() -> dict[str, Any] | None:
        found = client.get(f"/v1/sessions/{session}/events", params={"after": seq}).json()
        return next((e for e in found["events"] if e["type"] == "turn_ended"), None)

    event = wait_until(ended, 30, "the turn to end")
    assert event["payload"]["outcome"] == "completed", event
    return session


def workers(daemon: Daemon) -> list[str]:
    return sorted(daemon.worker_pids())


def refusals(daemon: Daemon) -> list[str]:
    return re.findall(r"control plane: refused (.*)", daemon.log())


def hello(worker: str, secret: str) -> dict[str, Any]:
    return {"type": "hello", "worker": worker, "pid": 1, "secret": secret}


def heartbeat(worker: str | None, **fields: Any) -> dict[str, Any]:
    """A heartbeat as `worker` (None: for MisbehavingAgent, which names its own worker)."""
    beat = {"type": "heartbeat", "sessions": 0, "turns": 0, "turns_served": 0, "mcp": {}}
    beat["append_latency"] = LATENCY
    return beat | fields | ({"worker": worker} if worker is not None else {})


# --- the socket -----------------------------------------------------------------------


def test_the_control_socket_is_0600_inside_the_0700_runtime_directory(daemons: Daemons) -> None:
    daemon = daemons().start()
    runtime = daemon.root / "run"
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    mode = (runtime / "control.sock").stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600, oct(mode)


# --- who may talk ---------------------------------------------------------------------


def test_strangers_wrong_secrets_and_takeovers_are_refused_and_logged_once_per_peer(
    daemons: Daemons, context: zmq.Context[Any], tmp_path: Path
) -> None:
    daemon = daemons(pool={"workers": 1, "spare": 0}, http=api(tmp_path)).start()
    (name,) = workers(daemon)
    thief = Peer(context, daemon, name.encode())  # the live worker's name as its identity
    guesser = Peer(context, daemon, b"guesser")  # speaks as the worker, guessing its secret
    stranger = Peer(context, daemon, None)  # an identity zmq makes up
    for attempt in range(3):
        thief.send(hello(name, f"{attempt}" * 64))
        thief.send(heartbeat(name))
        guesser.send(hello(name, f"{attempt}" * 64))
        stranger.send(hello("w7.1", "a" * 64))
    wait_until(lambda: len(refusals(daemon)) >= 3, 10, "three refusals in the log")
    with daemon.client() as client:
        session = turn(client, "hello")  # assigned to the one worker, not to the thief
        turn(client, "again", session)
    lines = refusals(daemon)
    assert len(lines) == 3, lines
    assert any(f"peer {name}: it uses worker {name}'s name" in line for line in lines), lines
    assert any(
        f"peer guesser: a hello as worker {name} with a wrong secret" in line for line in lines
    ), lines
    assert any("unknown identity; a hello as worker w7.1" in line for line in lines), lines
    assert not thief.received(), "the thief got a message meant for the worker"
    assert workers(daemon) == [name]


# --- every message is validated -------------------------------------------------------


def test_nothing_a_stranger_sends_ends_the_receive_loop(
    daemons: Daemons, context: zmq.Context[Any], tmp_path: Path
) -> None:
    hang_timeout = 1.5
    daemon = daemons(
        pool={"workers": 1, "spare": 1, "hang_timeout": hang_timeout}, http=api(tmp_path)
    ).start()
    name = workers(daemon)[0]
    garbage = Peer(context, daemon, b"garbage")
    for frames in (
        [b"not json"],
        [b"\xff\xfe\x00"],
        [b"a", b"b", b"c"],  # three frames
        [b""],
        [b"[1, 2]"],
        [{"type": "bogus", "worker": name}],
        [heartbeat(name, turns="x")],
        [heartbeat(name, mcp={"evil": 10**30})],
        [{"type": "committed", "worker": name, "session": "0" * 32, "seq": 1, "event_type": "x"}],
        [{"type": "committed", "worker": name, "session": "0" * 32, "seq": 10**30}],
    ):
        garbage.send(*frames)
    Peer(context, daemon, b"big").send(b"x" * (1 << 20))  # past MAXMSGSIZE: disconnected
    # A dead receive loop reads no heartbeat: by now every worker would be taken for hung.
    time.sleep(hang_timeout + 1.5)
    with daemon.client() as client:
        turn(client, "still serving")
        status = client.get("/v1/status").json()
    assert status["worker_restarts"] == 0, status
    assert all(slot["ready"] for slot in status["slots"]), status
    assert "hung" not in daemon.log()
    assert len([line for line in refusals(daemon) if line.startswith("peer garbage:")]) == 1


def test_a_worker_that_sends_a_malformed_message_is_replaced(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(
        pool={"workers": 1, "spare": 1}, agent={"class": AGENT}, http=api(tmp_path)
    ).start()
    frame = json.dumps(heartbeat(None, turns="x"))
    with daemon.client() as client:
        turn(client, f"/send-once {tmp_path / 'sent'} {frame}")  # continued after the kill
        status = client.get("/v1/status").json()
    found = re.search(
        r"worker (w\d+\.\d+) \(pid (\d+)\) sent a malformed message "
        r"\(heartbeat\.turns: Input should be a valid integer\); replacing it",
        daemon.log(),
    )
    assert found, daemon.log()
    assert f"worker {found[1]} (pid {found[2]}) exited with signal SIGKILL" in daemon.log()
    assert not psutil.pid_exists(int(found[2]))
    assert status["worker_restarts"] == 1, status


def test_a_supervisor_task_that_dies_stops_the_daemon_with_a_non_zero_exit(
    daemons: Daemons, tmp_path: Path
) -> None:
    marker = tmp_path / "sabotage"
    daemon = daemons(
        agent={"class": AGENT},
        http=api(tmp_path),
        # The stop waits for the turn in flight meanwhile, so /readyz can be watched.
        shutdown={"drain_budget": 2.0},
    )
    daemon.env[SABOTAGE] = str(marker)
    # The daemon imports this module first (the agent itself is loaded in its workers).
    daemon.launcher = [
        PYTHON,
        "-c",
        "import tests.security.test_control; from supervisor.cli.main import main; main()",
    ]
    daemon.start()
    readiness: list[int] = []
    with daemon.client() as client:
        assert client.get("/readyz").status_code == 200
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/inject", json={"text": "/sleep 20 slow"})

        def started() -> bool:
            found = client.get(f"/v1/sessions/{session}/events").json()["events"]
            return any(e["type"] == "turn_started" for e in found)

        wait_until(started, 30, "the turn to start")  # so that the drain waits for it
        marker.touch()  # the control plane's receive loop dies at once
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and 503 not in readiness:
            with contextlib.suppress(httpx.TransportError):
                readiness.append(client.get("/readyz").status_code)
            time.sleep(0.05)
    assert 503 in readiness, readiness
    assert daemon.wait(20) == 1
    log = daemon.log()
    assert re.search(
        r"CRITICAL.*task plane-receive died: RuntimeError\('sabotaged by the test'\)", log
    ), log
    with Store(daemon.url, migrate=False) as store:
        assert store.boots.recent(1)[0].outcome == "unclean"


# --- the vocabulary -------------------------------------------------------------------


def test_no_peer_can_create_a_metric_series(
    daemons: Daemons, context: zmq.Context[Any], tmp_path: Path
) -> None:
    daemon = daemons(
        pool={"workers": 1, "spare": 1}, agent={"class": AGENT}, http=api(tmp_path)
    ).start()
    with daemon.client() as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        event = {"seq": 1, "type": "invented"}  # also as the whole event, the way it once went
        invented = {"type": "committed", "session": session, "event_type": "invented"}
        invented |= {"seq": 1, "event": event}
        escape = heartbeat(None, mcp={"\x1b[2Jevil": "ready"})  # a name the status would show
        for n, frame in enumerate((invented, heartbeat(None, mcp={"evil": 1}), escape)):
            turn(client, f"/send-once {tmp_path / str(n)} {json.dumps(frame)}", session)
            assert "invented" not in client.get("/metrics").text
        stranger = Peer(context, daemon, b"stranger")
        stranger.send({**invented, "worker": workers(daemon)[0]})
        stranger.send(heartbeat(workers(daemon)[0], mcp={"evil": 1}))
        wait_until(lambda: refusals(daemon), 10, "the stranger to be refused")
        metrics = client.get("/metrics").text
        status = client.get("/v1/status").json()
    assert "invented" not in metrics and "evil" not in metrics
    assert "evil" not in json.dumps(status)
    assert 'turnkeeper_events_committed_total{type="turn_ended"}' in metrics
    assert status["worker_restarts"] == 3, status
    assert daemon.log().count("sent a malformed message") == 3


def test_a_heartbeat_names_each_mcp_server_and_its_state_within_bounds() -> None:
    def beat(**fields: Any) -> bytes:
        return json.dumps(heartbeat("w1.1", **fields)).encode()

    good = decode([beat(mcp={"files": "ready", "a shell": "backoff"}, turns_served=7)], WORKERS)
    assert isinstance(good, Heartbeat)
    assert (good.mcp, good.turns_served) == ({"files": "ready", "a shell": "backoff"}, 7)
    most = decode([beat(turns_served=MAX_SEQ)], WORKERS)
    assert isinstance(most, Heartbeat) and most.turns_served == MAX_SEQ
    unnamed = heartbeat("w1.1")
    del unnamed["turns_served"]
    refused: dict[str, bytes] = {
        "a control character": beat(mcp={"files\x1b[2J": "ready"}),
        "a C1 control character": beat(mcp={"files\x9b": "ready"}),
        "an empty name": beat(mcp={"": "ready"}),
        "a name too long": beat(mcp={"f" * (MAX_NAME + 1): "ready"}),
        "too many servers": beat(mcp={f"s{n}": "ready" for n in range(MAX_SERVERS + 1)}),
        "a count, not a state": beat(mcp={"files": 1}),
        "an unreported state": beat(mcp={"files": "new"}),
        "an invented state": beat(mcp={"files": "evil"}),
        "turns served below 0": beat(turns_served=-1),
        "turns served past any seq": beat(turns_served=MAX_SEQ + 1),
        "turns served as text": beat(turns_served="1"),
        "no turns served": json.dumps(unnamed).encode(),
    }
    for why, frame in refused.items():
        with pytest.raises(ProtocolError):
            decode([frame], WORKERS)
            pytest.fail(f"accepted a heartbeat with {why}")


def test_refusals_are_logged_once_per_peer_in_bounded_memory() -> None:
    now = [0.0]
    refusals = Refusals(size=4, burst=3, window=60.0, clock=lambda: now[0])
    assert [refusals.first(b"a"), refusals.first(b"a"), refusals.first(b"b")] == [0, None, 0]
    # Endless identities: three lines a minute, the rest only counted, memory stays at 4.
    assert [refusals.first(f"p{n}".encode()) for n in range(5)] == [0, None, None, None, None]
    assert len(refusals._seen) == 4
    now[0] = 61.0
    assert refusals.first(b"next") == 4  # the line says how many went unlogged
    assert refusals.first(b"a") == 0  # forgotten long ago: logged again, once
