"""File descriptors on a real daemon (issue 32): started under a low soft limit it raises
it to the hard one and says so, while the programs it runs get what they need (an MCP
server and a task's command the original soft limit, a worker the raised one); under a
low hard limit `http.max_connections` is clamped (and judged again when a reload grows
the pool) so that clients cannot run the daemon out of descriptors; and when it runs out
all the same (a limit lowered under it), it stops accepting for a moment, logs one line
and not a flood, and answers again once descriptors are free.

The limits are set as an operator's shell would (`prlimit` before the command, as
`ulimit -n` does, and `prlimit --pid` on the running daemon) and read back from
/proc/PID/limits."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import tomli_w

from supervisor.store import Store
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, daemons, turnkeeper, wait_until
from tests.tasks.test_tasks_daemon import FAST, KINDS, answered, command_pids, started

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(240)

TINY = {"name": "tiny", "command": [PYTHON, "-m", "tests.mcp_servers.tiny"], "cwd": str(REPO)}
STARVED_LINE = "out of file descriptors accepting connections"


def nofile(pid: int) -> tuple[int, int]:
    """The soft and hard RLIMIT_NOFILE of process `pid`, as the kernel shows them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open files limit for pid {pid}")


def under_prlimit(daemon: Daemon, soft: int, hard: int) -> Daemon:
    """`daemon` started by `prlimit --nofile=SOFT:HARD`, as after `ulimit -n` in a shell."""
    daemon.launcher = ["prlimit", f"--nofile={soft}:{hard}", *daemon.launcher]
    return daemon


def mcp_server(worker: psutil.Process) -> psutil.Process | None:
    """The worker's `tiny` MCP server, once it runs."""
    with contextlib.suppress(psutil.Error):
        for child in worker.children():
            if "tests.mcp_servers.tiny" in " ".join(child.cmdline()):
                return child
    return None


def one_worker(daemon: Daemon) -> psutil.Process | None:
    workers = daemon.live_workers()
    return workers[0] if len(workers) == 1 else None


def boot_id(daemon: Daemon) -> str | None:
    with contextlib.suppress(Exception):
        if daemon.ready():
            return str(daemon.status()["boot"]["id"])
    return None


def test_the_soft_limit_is_raised_for_the_daemon_and_its_workers_and_given_back_to_programs(
    daemons: Daemons,
) -> None:
    daemon = daemons(
        pool={"workers": 1},
        mcp={"servers": [TINY]},
        tasks={"kinds": KINDS, **FAST},
        restart={"drain_budget": 0.0},
    )
    under_prlimit(daemon, 256, 512).start()
    assert "file descriptors: soft limit raised from 256 to 512 (hard 512)" in daemon.log()
    assert nofile(daemon.pid) == (512, 512)
    worker = wait_until(lambda: one_worker(daemon), 30, "the worker")
    # A worker is turnkeeper's own code (epoll, never select()): it keeps the raised limit.
    assert nofile(worker.pid) == (512, 512)
    # An MCP server and a task's command may be any program: the original soft limit.
    server = wait_until(lambda: mcp_server(worker), 30, "the worker's MCP server")
    assert nofile(server.pid) == (256, 512)
    store = Store(daemon.url)
    try:
        session, task, gate = started(store, daemon, "gated")
        [command] = wait_until(lambda: command_pids(daemon), 30, "the task's command")
        assert nofile(command.pid) == (256, 512)
        assert task.runner_pid is not None and nofile(task.runner_pid) == (256, 512)
        gate.touch()
        wait_until(lambda: answered(store, session), 60, "the task's result")
    finally:
        store.close()

    # A restart in place re-executes with the original soft limit: the new start raises
    # it from there again, and its MCP server gets the original too.
    before = boot_id(daemon)
    asked = turnkeeper(daemon, "restart", "--no-wait")
    assert asked.returncode == 0, asked.stdout + asked.stderr
    wait_until(lambda: boot_id(daemon) not in (None, before), 90, "the new boot")
    assert daemon.log().count("soft limit raised from 256 to 512 (hard 512)") == 2
    assert nofile(daemon.pid) == (512, 512)
    worker = wait_until(lambda: one_worker(daemon), 30, "the new worker")
    server = wait_until(lambda: mcp_server(worker), 30, "the new worker's MCP server")
    assert nofile(server.pid) == (256, 512)


def connect(daemon: Daemon) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(15)
    conn.connect(str(daemon.root / "api.sock"))
    return conn


def ask(conn: socket.socket) -> None:
    """Send a keep-alive request for /healthz on `conn`."""
    conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: turnkeeper\r\n\r\n")


def answered_now(conn: socket.socket) -> bool:
    """Whether the answer to `ask` has come (without waiting for it)."""
    conn.setblocking(False)
    try:
        return b"200 OK" in conn.recv(65536)
    except BlockingIOError:
        return False
    finally:
        conn.settimeout(15)


def closed_by_peer(conn: socket.socket) -> bool:
    """Whether the daemon closed `conn` (reading nothing, waiting for nothing)."""
    conn.setblocking(False)
    try:
        while conn.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        conn.settimeout(15)
    return True


def test_under_a_low_limit_the_connection_cap_is_clamped_and_idle_clients_are_evicted(
    daemons: Daemons,
) -> None:
    daemon = under_prlimit(daemons(), 256, 256).start()
    log = daemon.log()
    found = re.search(r"serving at most (\d+) connections", log)
    assert found is not None, log
    cap = int(found[1])
    assert "http.max_connections 1024 does not fit: the file descriptor limit is 256" in log
    assert cap < 256 - len(os.listdir(f"/proc/{daemon.pid}/fd"))
    # `doctor` judges the running daemon's limit too, and says what it will serve.
    report = turnkeeper(daemon, "doctor").stdout
    assert (
        f"WARN  file descriptors: the running daemon's (pid {daemon.pid}) limit: 256 holds "
        f"{cap} connections"
    ) in report, report
    held: list[socket.socket] = []

    def hold() -> bool:
        conn = connect(daemon)
        try:
            ask(conn)
            if b"200 OK" in conn.recv(65536):
                held.append(conn)
                return True
        except OSError:
            pass
        conn.close()
        return False

    try:
        # More idle clients than the limit leaves room for: each past the cap evicts the
        # one idle longest, so every one of them is served and the daemon never runs out.
        for _ in range(256):
            wait_until(hold, 10, f"connection {len(held) + 1} to be served")
        wait_until(
            lambda: sum(not closed_by_peer(c) for c in held) <= cap,
            30,
            "the connections over the cap to be closed",
        )
        assert not closed_by_peer(held[-1])  # the newest is served, the idlest went
        status = turnkeeper(daemon, "status")
        assert status.returncode == 0, status.stdout + status.stderr
    finally:
        for conn in held:
            conn.close()
    log = daemon.log()
    assert "evicted the connection idle longest" in log
    assert STARVED_LINE not in log and "Too many open files" not in log


def test_a_reload_that_grows_the_pool_judges_the_cap_again(daemons: Daemons) -> None:
    daemon = under_prlimit(daemons(), 256, 256).start()
    before = [int(n) for n in re.findall(r"serving at most (\d+) connections", daemon.log())]
    assert len(before) == 1
    config = {**daemon.config, "pool": {**daemon.config["pool"], "workers": 4}}
    daemon.config_path.write_text(tomli_w.dumps(config))
    reload = turnkeeper(daemon, "reload")
    assert reload.returncode == 0, reload.stdout + reload.stderr
    found = wait_until(
        lambda: re.findall(r"serving at most (\d+) connections", daemon.log())[1:],
        30,
        "the cap judged again",
    )
    # Two more workers, each counted twice (a reload's replacements) at four descriptors.
    cap = int(found[0])
    assert cap == before[0] - 2 * 2 * 4
    held: list[socket.socket] = []
    try:
        for _ in range(before[0]):
            conn = connect(daemon)
            ask(conn)
            assert b"200 OK" in conn.recv(65536)
            held.append(conn)
        wait_until(
            lambda: sum(not closed_by_peer(c) for c in held) <= cap,
            30,
            "the connections over the new cap to be closed",
        )
    finally:
        for conn in held:
            conn.close()


def test_out_of_descriptors_accept_pauses_logs_one_line_and_serves_again_once_free(
    daemons: Daemons,
) -> None:
    # Long request-head timeouts: the clients held below stay connected however slow.
    daemon = daemons(http={"read_timeout": 300.0}).start()
    # Lowered under the running daemon (its cap was judged against the old limit): only
    # a few descriptors are left for connections.
    in_use = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (in_use + 3, in_use + 3))
    clients = [connect(daemon) for _ in range(12)]  # the kernel queues those not accepted
    try:
        for conn in clients:
            ask(conn)
        wait_until(lambda: STARVED_LINE in daemon.log(), 30, "the daemon to run out")
        served = wait_until(
            lambda: [c for c in clients if answered_now(c)] or None, 30, "a client served"
        )
        waiting = [c for c in clients if c not in served]
        assert waiting, "every client was accepted: the limit did not bite"
        # Descriptors freed (all the served clients', so that one the daemon takes for a
        # moment elsewhere, a database file, still leaves one): the next retry of accept
        # takes a waiting client and serves it.
        for conn in served:
            conn.close()
            clients.remove(conn)
        wait_until(
            lambda: any(answered_now(c) for c in waiting), 30, "a waiting client to be served"
        )
        log = daemon.log()
        # Each retry ran out again (the others still wait), yet one line tells it all.
        assert log.count(STARVED_LINE) == 1, log[-4000:]
        assert "Traceback" not in log and "out of system resource" not in log, log[-4000:]
        line = next(line for line in log.splitlines() if STARVED_LINE in line)
        assert line.startswith("20") and "[http]" in line and "EMFILE" in line, line
    finally:
        for conn in clients:
            conn.close()
    status = wait_until(
        lambda: (s := turnkeeper(daemon, "status")).returncode == 0 and s,
        60,
        "`turnkeeper status` to answer",
    )
    assert "ready" in status.stdout.lower(), status.stdout
