"""`send --wait` and `attach` with a turn's live output, as a user runs them: the CLI as a
real process (on a terminal where that is the point) against a small HTTP server of this
test's on a unix socket, which answers an inject and serves an attach stream written with
the daemon's own encoders: the committed events of a turn, and between them its deltas
(two of an earlier turn first, which `send --wait` must not print).

On a terminal, `send --wait` prints the text as it streams and the tool call it
announces, then of the committed events only what the stream did not show (the end of an
answer whose last deltas were missed); piped, the committed lines only, as before.
`--json` prints each delta as one line (`"type": "delta"`, no seq) before the document
(on one line); `--no-stream` prints only what was committed. `attach --json` prints the
deltas between the events, `attach --no-stream --json` the events only.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from supervisor.http.attach import delta_sse
from supervisor.http.pages import sse_body
from supervisor.runtime.bus import Delta
from tests.conftest import PYTHON, REPO
from tests.support import cli_env, ctrl_c, run_turnkeeper

SESSION = "5" * 32
TURN, EARLIER = "a" * 32, "e" * 32
WAIT_S = 30.0  # a bound on waiting for what must happen, not a measure of speed


def event(seq: int, kind: str, payload: dict[str, object]) -> bytes:
    return sse_body([(seq, kind, TURN, json.dumps(payload), 1_800_000_000.0 + seq)])


def delta(index: int, text: str = "", tool_call: str | None = None, turn: str = TURN) -> bytes:
    return delta_sse(Delta(SESSION, turn, index, text, tool_call))


# What the stream after seq 5 (the message) holds: the committed events of the turn, and
# its deltas. The last answer's final delta never came: the committed text has more.
STREAM = [
    delta(7, "an earlier turn's ", turn=EARLIER),
    delta(8, "last words", turn=EARLIER),
    event(6, "turn_started", {}),
    delta(0, "Hel"),
    delta(1, "lo"),
    delta(2, tool_call="search"),
    event(7, "model_response", {"text": "Hello", "tool_calls": [{"name": "search"}]}),
    event(8, "tool_call", {"name": "search", "arguments": {}}),
    event(9, "tool_result", {"name": "search", "text": "found"}),
    delta(3, "all "),
    event(10, "model_response", {"text": "all done"}),
    event(11, "turn_ended", {"outcome": "completed"}),
]


@dataclass
class Server:
    """The daemon's API as far as these commands use it, on a unix socket."""

    socket: Path
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def inject(self, request: web.Request) -> web.Response:
        return web.json_response({"seq": 5}, status=202)

    async def attach(self, request: web.Request) -> web.StreamResponse:
        after = request.headers.get("Last-Event-ID", "0")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if int(after) <= 5:
            for part in STREAM:
                await response.write(part)
        await self.stop.wait()  # open until the end of the test, as a live stream is
        return response

    def serve(self, started: threading.Event) -> None:
        async def main() -> None:
            app = web.Application()
            app.router.add_post("/v1/sessions/{id}/inject", self.inject)
            app.router.add_get("/v1/sessions/{id}/attach", self.attach)
            runner = web.AppRunner(app, shutdown_timeout=0.1)
            await runner.setup()
            await web.UnixSite(runner, str(self.socket)).start()
            started.set()
            await self.stop.wait()
            await runner.cleanup()

        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(main())
        self.loop.close()


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    """A configuration whose `http.listen` is the test's server (no daemon runs)."""
    server = Server(tmp_path / "api.sock")
    started = threading.Event()
    thread = threading.Thread(target=server.serve, args=(started,), daemon=True)
    thread.start()
    assert started.wait(WAIT_S)
    path = tmp_path / "turnkeeper.toml"
    state = tmp_path / "state"
    path.write_text(f'[daemon]\nstate_dir = "{state}"\n[http]\nlisten = "unix:{server.socket}"\n')
    try:
        yield path
    finally:
        server.loop.call_soon_threadsafe(server.stop.set)
        thread.join(WAIT_S)


def env() -> dict[str, str]:
    return cli_env(TURNKEEPER_TOKEN="t", NO_COLOR="1")


def on_a_terminal(config: Path, *args: str) -> tuple[int, str]:
    """The CLI run on a pseudo-terminal until it exits: its exit code and what it showed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the terminal
        os.chdir(REPO)
        os.execve(PYTHON, [PYTHON, "-m", "supervisor", "--config", str(config), *args], env())
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], WAIT_S)
            assert ready, f"the command did not finish: {seen!r}"
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the terminal closed: the CLI exited
                break
            if not chunk:
                break
            seen += chunk
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), seen.decode().replace("\r\n", "\n")


def test_send_wait_on_a_terminal_prints_the_text_as_it_streams(config: Path) -> None:
    code, shown = on_a_terminal(config, "send", SESSION, "hi", "--wait")
    assert code == 0, shown
    # The streamed text, the call announced, then only what the deltas missed ("done").
    assert shown == "committed as seq 5\nHello\n[calling search…]\nall done\n"


def test_send_wait_no_stream_on_a_terminal_prints_the_committed_events(config: Path) -> None:
    code, shown = on_a_terminal(config, "send", SESSION, "hi", "--wait", "--no-stream")
    assert code == 0, shown
    assert shown == "committed as seq 5\nHello\n[tool search]\nall done\n"


def test_send_wait_piped_prints_the_committed_events(config: Path) -> None:
    piped = run_turnkeeper("send", SESSION, "hi", "--wait", env=env(), config=config)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == "Hello\n[tool search]\nall done\n"


def test_send_wait_json_prints_each_delta_as_a_line_then_the_document(config: Path) -> None:
    sent = run_turnkeeper("send", SESSION, "hi", "--wait", "--json", env=env(), config=config)
    assert sent.returncode == 0, sent.stderr
    lines = [json.loads(line) for line in sent.stdout.splitlines()]
    assert lines == [
        {"type": "delta", "turn": TURN, "index": 0, "text": "Hel", "tool_call": None},
        {"type": "delta", "turn": TURN, "index": 1, "text": "lo", "tool_call": None},
        {"type": "delta", "turn": TURN, "index": 2, "text": "", "tool_call": "search"},
        {"type": "delta", "turn": TURN, "index": 3, "text": "all ", "tool_call": None},
        {
            "seq": 5,
            "turn_id": TURN,
            "outcome": "completed",
            "error": None,
            "reply": "Hello\nall done",
        },
    ]
    quiet = run_turnkeeper(
        "send", SESSION, "hi", "--wait", "--json", "--no-stream", env=env(), config=config
    )
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout) == lines[-1]  # one document, as without live output


def attach_lines(config: Path, count: int, *args: str) -> list[dict[str, object]]:
    """The first `count` lines `attach --json ARGS` prints, then Ctrl-C."""
    proc = subprocess.Popen(
        [PYTHON, "-m", "supervisor", "--config", str(config), "attach", SESSION, "--json", *args],
        cwd=REPO,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline()) for _ in range(count)]
    finally:
        assert ctrl_c(proc) == 0
    return lines


def test_attach_json_prints_the_deltas_between_the_events(config: Path) -> None:
    lines = attach_lines(config, len(STREAM))
    kinds = [(line["type"], line.get("seq"), line.get("index")) for line in lines]
    assert kinds == [
        ("delta", None, 7),
        ("delta", None, 8),
        ("turn_started", 6, None),
        ("delta", None, 0),
        ("delta", None, 1),
        ("delta", None, 2),
        ("model_response", 7, None),
        ("tool_call", 8, None),
        ("tool_result", 9, None),
        ("delta", None, 3),
        ("model_response", 10, None),
        ("turn_ended", 11, None),
    ]
    call = {"type": "delta", "turn": TURN, "index": 2, "text": "", "tool_call": "search"}
    assert lines[5] == call


def test_attach_no_stream_prints_only_the_committed_events(config: Path) -> None:
    lines = attach_lines(config, 6, "--no-stream")
    assert [line["seq"] for line in lines] == [6, 7, 8, 9, 10, 11]
