"""MCP tool servers in the worker: real stdio children, their groups, restarts and calls.

The servers are the SDK-written ones in `tests/mcp_servers`. The restart timing is tested
on `RestartPolicy` with a fake clock; the process tests use real processes and signals,
and kill every process they started, by pid, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mcp_types
import psutil
import pytest
from loguru import logger

from supervisor.contract.config import McpServer
from supervisor.contract.mcp_env import child_environment
from supervisor.contract.reaper import ProcessId
from supervisor.core.backoff import Backoff
from supervisor.core.vocabulary import McpState
from workers.mcp import (
    McpTools,
    RestartPolicy,
    function_name,
    offered_names,
    outcome_of,
)
from workers.models import ToolSpec
from workers.tools import BuiltinTools, Toolboxes, ToolOutcome

REPO = Path(__file__).resolve().parents[2]
START = 60.0  # seconds; importing the SDK alone takes seconds on a busy machine


def server(name: str, module: str, **settings: Any) -> McpServer:
    """The config of a test server from `tests/mcp_servers`."""
    settings.setdefault("start_timeout", START)
    return McpServer(
        name=name,
        command=[sys.executable, "-m", f"tests.mcp_servers.{module}"],
        cwd=str(REPO),
        **settings,
    )


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie counts: an init that does not reap keeps them)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    until = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > until:
            return False
        time.sleep(0.02)
    return True


def read_pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


class Children:
    """Records the on_start / on_exit callbacks; kills whatever is left, by pid."""

    def __init__(self) -> None:
        self.started: list[tuple[str, int, float, int]] = []
        self.exited: list[tuple[str, int]] = []
        self.extra: list[ProcessId] = []

    async def on_start(self, name: str, pid: int, create_time: float, pgid: int) -> None:
        self.started.append((name, pid, create_time, pgid))

    async def on_exit(self, name: str, pid: int) -> None:
        self.exited.append((name, pid))

    def pids(self, name: str) -> list[int]:
        return [pid for server, pid, _, _ in self.started if server == name]

    def adopt(self, pids: list[int]) -> None:
        """Also kill these at the end (grandchildren the servers reported)."""
        self.extra.extend(p for pid in pids if (p := ProcessId.of(pid)) is not None)

    def kill_all(self) -> None:
        ids = [ProcessId(pid, created) for _, pid, created, _ in self.started] + self.extra
        for ident in ids:
            proc = ident.process()  # None if gone, or if its pid now names another process
            with contextlib.suppress(psutil.Error):
                if proc is not None and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()


@pytest.fixture
def children() -> Iterator[Children]:
    tracker = Children()
    try:
        yield tracker
    finally:
        tracker.kill_all()


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="DEBUG", format="{message}")
    try:
        yield lines
    finally:
        logger.remove(sink)


# --- pure parts ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_restart_delay_doubles_up_to_30_seconds() -> None:
    clock = FakeClock()
    policy = RestartPolicy(clock)
    delays = []
    for _ in range(9):
        clock.now += 16  # 4 crashes at most in any 60 s: never down
        policy.started()
        delays.append(policy.crashed())
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert not policy.down


def test_five_crashes_within_60_seconds_are_down_for_good() -> None:
    clock = FakeClock()
    policy = RestartPolicy(clock)
    delays = []
    for _ in range(5):
        clock.now += 10
        delays.append(policy.crashed())
    assert delays == [0.5, 1, 2, 4, None]
    clock.now += 3600
    assert policy.crashed() is None
    assert policy.down


def test_crashes_older_than_the_window_do_not_count() -> None:
    clock = FakeClock()
    policy = RestartPolicy(clock)
    for at in (0, 15, 30, 45, 61, 76):  # never 5 within 60 s
        clock.now = 1000.0 + at
        assert policy.crashed() is not None


def test_a_stable_run_resets_the_delay() -> None:
    clock = FakeClock()
    policy = RestartPolicy(clock)
    assert [policy.crashed(), policy.crashed()] == [0.5, 1]
    policy.started()
    clock.now += 59
    assert policy.crashed() == 2  # not stable yet
    policy.started()
    clock.now += 60
    assert policy.crashed() == 0.5


def test_offered_names_keep_the_servers_names_and_prefix_on_a_clash() -> None:
    long = "t" * 70
    names = offered_names(
        [("files", ["read", "echo", "do.it"]), ("web", ["read", long, "get"])],
        reserved=["echo"],
    )
    assert names == {
        "read": ("files", "read"),
        "files__echo": ("files", "echo"),
        "do_it": ("files", "do.it"),
        "web__read": ("web", "read"),
        "t" * 64: ("web", long),
        "get": ("web", "get"),
    }
    assert function_name("a b/c") == "a_b_c"
    again = offered_names([("a", ["x", "x", "x"])])
    assert list(again) == ["x", "a__x", "a__x_2"]


def test_child_environment_is_minimal() -> None:
    source = {
        "PATH": "/bin",
        "HOME": "/home/tk",
        "LANG": "C.UTF-8",
        "TZ": "UTC",
        "USER": "tk",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "TURNKEEPER_POOL__WORKERS": "4",
        "OPENAI_API_KEY": "sk-secret",
        "PYTHONPATH": "/src",
    }
    env = child_environment({"FILES_ROOT": "/srv", "LANG": "de_DE.UTF-8"}, source)
    assert env == {
        "PATH": "/bin",
        "HOME": "/home/tk",
        "LANG": "de_DE.UTF-8",
        "TZ": "UTC",
        "USER": "tk",
        "FILES_ROOT": "/srv",
    }


def test_outcome_joins_the_text_of_the_content_items() -> None:
    result = mcp_types.CallToolResult(
        content=[
            mcp_types.TextContent(text="one"),
            mcp_types.ImageContent(data="AAAA", mime_type="image/png"),
            mcp_types.TextContent(text="two"),
        ],
        is_error=True,
    )
    assert outcome_of(result) == ToolOutcome("one\n[image image/png, 4 bytes of base64]\ntwo", True)
    structured = mcp_types.CallToolResult(content=[], structured_content={"n": 1})
    assert outcome_of(structured) == ToolOutcome('{"n": 1}')


class Fixed:
    def __init__(self, label: str, *names: str) -> None:
        self.label = label
        self.names = names

    def specs(self) -> list[ToolSpec]:
        return [ToolSpec(name, self.label, {"type": "object"}) for name in self.names]

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome(f"{self.label}:{name}")


def test_toolboxes_offer_each_name_once_and_route_to_the_first() -> None:
    boxes = Toolboxes(BuiltinTools(), Fixed("a", "echo", "x"), Fixed("b", "x", "y"))
    assert [spec.name for spec in boxes.specs()] == ["echo", "sleep", "x", "y"]

    async def calls() -> list[ToolOutcome]:
        return [
            await boxes.call("echo", {"k": 1}),
            await boxes.call("x", {}),
            await boxes.call("y", {}),
            await boxes.call("z", {}),
        ]

    echo, x, y, z = asyncio.run(calls())
    assert echo == ToolOutcome('{"k": 1}')
    assert (x, y) == (ToolOutcome("a:x"), ToolOutcome("b:y"))
    assert z.is_error and "unknown tool 'z'" in z.content


# --- real servers --------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_tools_calls_hygiene_and_groups(
    children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("TURNKEEPER_SECRET_KEY", "tk-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    names = ["NOTIFY_SOCKET", "TURNKEEPER_SECRET_KEY", "OPENAI_API_KEY", "NAMED", "PATH"]

    async def scenario() -> dict[str, Any]:
        tools = McpTools(
            [server("one", "basic", env={"NAMED": "given"}), server("two", "basic")],
            on_start=children.on_start,
            on_exit=children.on_exit,
            reserved=["echo"],
        )
        try:
            await tools.start()
            pids = {c.name: c.process.pid for c in tools.clients if c.process}
            found = {
                "specs": {spec.name: spec for spec in tools.specs()},
                "add": await tools.call("add", {"a": 1, "b": 2}),
                "add2": await tools.call("two__add", {"a": 2, "b": 2.5}),
                "fail": await tools.call("fail", {}),
                "whoami": await tools.call("whoami", {"names": names}),
                "unknown": await tools.call("nope", {}),
                "pids": pids,
                "pgids": {name: os.getpgid(pid) for name, pid in pids.items()},
                "created": {name: psutil.Process(pid).create_time() for name, pid in pids.items()},
            }
        finally:
            await tools.aclose(2.0)
        found["gone"] = {name: gone(pid) for name, pid in pids.items()}
        return found

    found = asyncio.run(scenario())
    specs = found["specs"]
    assert specs["add"] == ToolSpec(
        "add", "Add two numbers.", specs["add"].input_schema, read_only=True, idempotent=True
    )
    assert specs["add"].input_schema["required"] == ["a", "b"]
    assert (specs["whoami"].read_only, specs["whoami"].idempotent) == (True, False)
    assert (specs["die"].read_only, specs["die"].idempotent) == (False, False)
    assert {"two__add", "two__slow", "two__fail", "two__whoami", "two__die"} <= set(specs)
    assert found["add"] == ToolOutcome("3")
    assert found["add2"] == ToolOutcome("4.5")
    assert found["fail"].is_error and "fail always fails" in found["fail"].content
    assert found["unknown"].is_error and "unknown tool 'nope'" in found["unknown"].content

    whoami = json.loads(found["whoami"].content)
    assert whoami["pid"] == found["pids"]["one"]
    assert whoami["env"] == {
        "NOTIFY_SOCKET": None,
        "TURNKEEPER_SECRET_KEY": None,
        "OPENAI_API_KEY": None,
        "NAMED": "given",
        "PATH": os.environ["PATH"],
    }
    assert not [name for name in whoami["names"] if name.startswith("TURNKEEPER_")]

    assert found["pgids"] == found["pids"]  # each leads its own process group
    assert found["gone"] == {"one": True, "two": True}
    for name, pid in found["pids"].items():
        [(_, started_pid, created, pgid)] = [s for s in children.started if s[0] == name]
        assert (started_pid, pgid, created) == (pid, pid, found["created"][name])
    assert sorted(children.exited) == sorted(found["pids"].items())


@pytest.mark.timeout(90)
def test_a_call_past_its_timeout_fails_fast_and_the_server_stays(children: Children) -> None:
    async def scenario() -> tuple[ToolOutcome, float, ToolOutcome, list[int]]:
        tools = McpTools([server("basic", "basic", call_timeout=1.0)], on_start=children.on_start)
        try:
            await tools.start()
            began = time.monotonic()
            slow = await tools.call("slow", {"seconds": 30})
            took = time.monotonic() - began
            after = await tools.call("add", {"a": 2, "b": 3})
        finally:
            await tools.aclose(2.0)
        return slow, took, after, children.pids("basic")

    slow, took, after, pids = asyncio.run(scenario())
    assert slow.is_error and "did not answer within 1 s" in slow.content
    assert 0.9 < took < 3.0
    assert after == ToolOutcome("5")
    assert len(pids) == 1  # the same process answered: not restarted


@pytest.mark.timeout(120)
def test_a_server_dying_mid_call_is_restarted(children: Children, log_lines: list[str]) -> None:
    async def scenario() -> tuple[ToolOutcome, bool, ToolOutcome]:
        tools = McpTools(
            [server("basic", "basic")], on_start=children.on_start, on_exit=children.on_exit
        )
        try:
            await tools.start()
            died = await tools.call("die", {"code": 3})
            ready = await tools.clients[0].wait_ready(START)
            again = await tools.call("add", {"a": 1, "b": 1})
        finally:
            await tools.aclose(2.0)
        return died, ready, again

    died, ready, again = asyncio.run(scenario())
    assert died.is_error
    assert "'basic' exited (exit code 3) during the call; it is being restarted" in died.content
    assert ready and again == ToolOutcome("2")
    first, second = children.pids("basic")
    assert first != second
    assert children.exited == [("basic", first), ("basic", second)]
    assert any(f"basic[{first}]: basic: dying on request" in line for line in log_lines)
    assert any("'basic' exited (exit code 3); restarting in 0.5 s" in line for line in log_lines)


@pytest.mark.timeout(120)
def test_a_crash_loop_marks_the_server_down_and_the_others_work(
    children: Children, tmp_path: Path, log_lines: list[str]
) -> None:
    refuse = tmp_path / "refuse"

    async def scenario() -> tuple[ToolOutcome, McpState, ToolOutcome, ToolOutcome]:
        tools = McpTools(
            [
                server("flaky", "basic", env={"BASIC_REFUSE_IF_EXISTS": str(refuse)}),
                server("steady", "stubborn"),
            ],
            on_start=children.on_start,
            policy=lambda: RestartPolicy(backoff=Backoff(initial=0.05)),
        )
        flaky = tools.clients[0]
        try:
            await tools.start()
            refuse.touch()  # from now on, every restart of flaky exits at once
            died = await tools.call("die", {})
            while flaky.state is not McpState.DOWN:
                await asyncio.sleep(0.02)
            down = await tools.call("add", {"a": 1, "b": 2})
            ping = await tools.call("ping", {})
        finally:
            await tools.aclose(2.0)
        return died, flaky.state, down, ping

    died, state, down, ping = asyncio.run(scenario())
    assert died.is_error and "exited" in died.content
    assert state is McpState.STOPPED  # after aclose
    assert down.is_error and "'flaky' is unavailable" in down.content
    assert ping == ToolOutcome("pong")
    restarts = [line for line in log_lines if "'flaky'" in line and "restarting in" in line]
    assert len(restarts) == 4  # the fifth crash within 60 s is the last
    assert sum("'flaky' exited while starting (exit code 2)" in line for line in log_lines) == 4
    assert any("'flaky' exited while starting" in line and "DOWN" in line for line in log_lines)
    assert len(children.pids("steady")) == 1


@pytest.mark.timeout(90)
def test_aclose_stops_every_group_within_the_grace(children: Children, tmp_path: Path) -> None:
    in_group, escaped = tmp_path / "group.pids", tmp_path / "escaped.pids"
    env = {"SPAWNER_GROUP_PID_FILE": str(in_group), "SPAWNER_ESCAPED_PID_FILE": str(escaped)}
    grace = 1.0

    async def scenario() -> float:
        tools = McpTools(
            [server("stubborn", "stubborn"), server("spawner", "spawner", env=env)],
            on_start=children.on_start,
            on_exit=children.on_exit,
        )
        try:
            await tools.start()
            assert await tools.call("ping", {}) == ToolOutcome("pong")
            assert await tools.call("spawner__ping", {}) == ToolOutcome("pong")
        finally:
            children.adopt(read_pids(in_group) + read_pids(escaped))
            began = time.monotonic()
            await tools.aclose(grace)
            took = time.monotonic() - began
        return took

    try:
        took = asyncio.run(scenario())
    finally:
        # setsid took it out of the group, out of aclose's reach: the supervisor catches
        # those as a subreaper. Here the test kills it.
        children.kill_all()
    assert grace <= took < grace + 0.5  # stubborn ignores SIGTERM: SIGKILL at the deadline
    [stubborn] = children.pids("stubborn")
    [spawner] = children.pids("spawner")
    [grandchild] = read_pids(in_group)
    assert gone(stubborn) and gone(spawner) and gone(grandchild)
    assert sorted(children.exited) == [("spawner", spawner), ("stubborn", stubborn)]


@pytest.mark.timeout(120)
def test_a_server_that_exits_cleanly_leaves_no_grandchild_in_its_group(
    children: Children, tmp_path: Path
) -> None:
    in_group, escaped = tmp_path / "group.pids", tmp_path / "escaped.pids"
    env = {"SPAWNER_GROUP_PID_FILE": str(in_group), "SPAWNER_ESCAPED_PID_FILE": str(escaped)}

    async def scenario() -> tuple[ToolOutcome, list[int], bool]:
        tools = McpTools([server("spawner", "spawner", env=env)], on_start=children.on_start)
        client = tools.clients[0]
        try:
            await tools.start()
            first_group = read_pids(in_group)
            children.adopt(first_group + read_pids(escaped))
            bye = await tools.call("quit", {})
            while len(children.pids("spawner")) < 2:
                await asyncio.sleep(0.05)  # restarted after 0.5 s
            # The old group is stopped before the restart: its grandchild is gone by now.
            killed = [await asyncio.to_thread(wait_gone, pid, 0.1) for pid in first_group]
            ready = await client.wait_ready(START)
        finally:
            children.adopt(read_pids(in_group) + read_pids(escaped))
            await tools.aclose(2.0)
        return bye, first_group, all(killed) and ready

    try:
        bye, first_group, killed_and_ready = asyncio.run(scenario())
    finally:
        children.kill_all()
    assert bye == ToolOutcome("bye")
    assert len(first_group) == 1
    assert killed_and_ready
    assert all(gone(pid) for pid in read_pids(in_group))


@pytest.mark.timeout(60)
def test_a_missing_command_is_logged_and_its_tools_are_unavailable(
    log_lines: list[str],
) -> None:
    missing = McpServer(name="ghost", command=["/nonexistent/mcp-ghost", "--stdio"])

    async def scenario() -> tuple[bool, list[ToolSpec], ToolOutcome, McpState, ToolOutcome]:
        tools = McpTools(
            [missing], policy=lambda: RestartPolicy(backoff=Backoff(initial=0.01), max_crashes=3)
        )
        client = tools.clients[0]
        try:
            started = await client.start()
            specs = tools.specs()
            unknown = await tools.call("read", {})
            while client.state is not McpState.DOWN:
                await asyncio.sleep(0.02)
            down = await client.call("read", {})
            return started, specs, unknown, client.state, down
        finally:
            await tools.aclose(1.0)

    started, specs, unknown, state, down = asyncio.run(scenario())
    assert not started and specs == []
    assert unknown.is_error and "tools unknown: ghost" in unknown.content
    assert state is McpState.DOWN
    assert down.is_error and "unavailable" in down.content
    assert any(
        "'ghost' cannot be started: command '/nonexistent/mcp-ghost': No such file or directory"
        in line
        for line in log_lines
    )


@pytest.mark.timeout(60)
def test_a_stop_interrupts_a_start_in_progress(children: Children) -> None:
    # `sleep` never answers initialize: the start would last start_timeout.
    mute = McpServer(name="mute", command=["sleep", "300"], start_timeout=300)

    async def scenario() -> tuple[bool, float]:
        tools = McpTools([mute], on_start=children.on_start, on_exit=children.on_exit)
        start = asyncio.create_task(tools.clients[0].start())
        while not children.started:
            await asyncio.sleep(0.01)
        began = time.monotonic()
        await tools.aclose(1.0)
        return await start, time.monotonic() - began

    started, took = asyncio.run(scenario())
    [pid] = children.pids("mute")
    assert not started and took < 1.0  # sleep obeys SIGTERM: no wait for the deadline
    assert gone(pid) and children.exited == [("mute", pid)]


@pytest.mark.timeout(30)
def test_the_child_dies_with_its_parent() -> None:
    # PR_SET_PDEATHSIG: a worker killed with SIGKILL takes its MCP servers along.
    script = (
        "import asyncio, sys\n"
        "from supervisor.contract.config import McpServer\n"
        "from workers.mcp import McpServerClient\n"
        "async def main():\n"
        "    client = McpServerClient(McpServer(name='s', command=['sleep', '300']))\n"
        "    asyncio.create_task(client.start())\n"
        "    while client.process is None:\n"
        "        await asyncio.sleep(0.01)\n"
        "    print(client.process.pid, flush=True)\n"
        "    await asyncio.sleep(300)\n"
        "asyncio.run(main())\n"
    )
    worker = psutil.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE)
    child = None
    try:
        assert worker.stdout is not None
        with worker.stdout:
            child = int(worker.stdout.readline())
        assert not gone(child)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        assert wait_gone(child, 5)
    finally:
        with contextlib.suppress(psutil.Error):
            worker.kill()
        if child is not None and not gone(child):
            os.kill(child, signal.SIGKILL)
