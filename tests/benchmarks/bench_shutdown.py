"""Shutdown time of a whole process tree: the real daemon, 4 workers, 4 MCP servers each.

The stop (docs/architecture.md) stops every descendant at once: SIGTERM to all, one shared
`shutdown.kill_grace` deadline, SIGKILL to the rest. This benchmark measures the wall
time from SIGTERM to the daemon's exit (`turnkeeper run` as a real process,
`tests.daemon.Daemon`, `pool.workers = 4, pool.spare = 0`, HTTP on a unix socket in the
temporary directory) for two trees, each on a fresh state dir per run:

- `stubborn`: per worker, 3 `tests.mcp_servers.stubborn` (they ignore SIGTERM) and one
  `tests.mcp_servers.spawner` (it starts two grandchildren that sleep forever, one in its
  process group and one that escaped it with setsid). Expected: about kill_grace plus a
  little; `target_s` is kill_grace + 1.
- `well_behaved`: per worker, 4 `tests.mcp_servers.basic`. Expected: well under a second.

A run starts the daemon and waits until it logged "ready" and the current boot has
recorded 16 children of kind "mcp" that are all alive (and, for `stubborn`, until the
spawners wrote the pids of their 8 grandchildren); that time is reported as `startup_s`.
It then takes a snapshot of the tree (the daemon, the recorded workers and MCP servers,
the grandchildren from the spawner's pid files and every other descendant of the daemon,
each as (pid, create_time)), sends SIGTERM, and waits for the daemon's exit on a pidfd.
Right after the exit it counts the processes of the snapshot that are still alive (not
zombies), by kind; it should count 0. Every process this benchmark starts carries a
marker in its environment (the daemon and the workers through the daemon's environment,
the MCP servers and their children through each server's `env`); any marked process
alive after a run, in the snapshot or not, is reported under `leftovers` and SIGKILLed
by pid.

`sequential_estimate`: what a stop one process after another would take, each given the
same grace before SIGKILL (as supervisord does, group by group). Measured on one more
`stubborn` tree: the daemon and the workers are first frozen with SIGSTOP (so that
nobody restarts what is being stopped, as a supervisor in its stop sequence does not),
then every process is stopped alone with `supervisor.contract.reaper.terminate([proc], grace)`
(which also sends SIGCONT): the 16 MCP servers, the 8 grandchildren, the 4 workers, and
last the daemon (which stops the helpers left, such as multiprocess's resource tracker).
Reported with the computed figure: processes that ignore SIGTERM x grace + the measured
time of the others.

The sequential estimate runs first, then `--runs` pairs (one `stubborn` run, one
`well_behaved` run); min/median/max are over the runs of each tree. Starting 16 Python MCP
servers costs about 2.5 s of CPU each, so each start takes tens of seconds on a small
machine: no new pair starts when the longest pair so far would end past `--budget`
(reported as `runs_skipped_for_budget`). A run slower than its target, or leaving a
process alive, reports the daemon's log from "received SIGTERM" on (`shutdown_log`).

    python -m tests.benchmarks shutdown [--runs N] [--quick] [--budget SECONDS]

Prints one JSON object. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from supervisor.contract.config import AgentConfig, ShutdownConfig
from supervisor.contract.reaper import ProcessId, descendants, terminate
from supervisor.store import Store
from tests.benchmarks.figures import shipped_pool, wait_for
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon

T = TypeVar("T")

WORKERS = 4
KILL_GRACE = ShutdownConfig().kill_grace  # the default, 3.0
TREES: dict[str, list[str]] = {  # the MCP servers of each worker, by module
    "stubborn": ["stubborn", "stubborn", "stubborn", "spawner"],
    "well_behaved": ["basic", "basic", "basic", "basic"],
}
IGNORES_SIGTERM = {"stubborn"}
WELL_BEHAVED_TARGET_S = 1.0
DEFAULT_RUNS = 3
QUICK_RUNS = 1
BUDGET_S = 290.0  # no new pair of runs starts when it would likely end past this
MCP_START_TIMEOUT_S = 60.0  # each server's start_timeout
STARTUP_TIMEOUT_S = 150.0  # the whole tree, daemon start to 16 live MCP servers
EXIT_TIMEOUT_S = 60.0
SETTLE_S = 0.5  # after the tree is up, before SIGTERM
POLL_S = 0.05
MARKER_VAR = "TURNKEEPER_BENCH_SHUTDOWN"
PID_FILES = {"group": "SPAWNER_GROUP_PID_FILE", "escaped": "SPAWNER_ESCAPED_PID_FILE"}

_STOPPED = re.compile(
    r"(\d+) processes stopped in ([\d.]+) s: (\d+) exited on SIGTERM, (\d+) needed SIGKILL"
    r"(?:, (\d+) SURVIVED)?"
)
_STOPPED_CLEANLY = re.compile(r"stopped (?:cleanly|with every slot fatal) in ([\d.]+) s")


def stats_s(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {
        "n": len(values),
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


def _alive(pid: ProcessId) -> bool:
    """Whether the process is still there and not a zombie (pid reuse ruled out)."""
    proc = pid.process()
    if proc is None:
        return False
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> dict[str, Any]:
    try:
        proc = psutil.Process(pid)
        return {"pid": pid, "ppid": proc.ppid(), "cmdline": " ".join(proc.cmdline())[:160]}
    except psutil.Error:
        return {"pid": pid}


def _read_pids(path: Path) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(line) for line in path.read_text().split() if line.strip().isdigit()]
    return []


def marked(marker: str) -> list[psutil.Process]:
    """Every live process (not a zombie) whose environment carries `marker`."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(MARKER_VAR) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_marked(marker: str) -> list[dict[str, Any]]:
    """SIGKILL every marked process, by pid; returns what was found."""
    found = [_describe(p.pid) for p in marked(marker)]
    for entry in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry["pid"], signal.SIGCONT)
            os.kill(entry["pid"], signal.SIGKILL)
    return found


@dataclass(frozen=True)
class Member:
    """One process of the tree, in the snapshot taken before the stop."""

    kind: str  # daemon, worker, mcp, grandchild, other
    pid: ProcessId
    worker: str | None = None


class Tree:
    """One daemon with 4 workers and 4 MCP servers per worker, in its own state dir."""

    def __init__(self, root: Path, modules: list[str], marker: str, grace: float) -> None:
        self.root = root
        self.modules = modules
        self.marker = marker
        self.pid_files = {kind: root / f"spawner-{kind}.pids" for kind in PID_FILES}
        env = {MARKER_VAR: marker}
        env.update({var: str(self.pid_files[kind]) for kind, var in PID_FILES.items()})
        self.daemon = Daemon(
            root,
            pool=shipped_pool(WORKERS, 0),
            agent={"class": AgentConfig().class_},
            http={"listen": f"unix:{root / 'http.sock'}"},
            mcp={
                "servers": [
                    {
                        "name": f"{module}{index}",
                        "command": [PYTHON, "-m", f"tests.mcp_servers.{module}"],
                        "cwd": str(REPO),
                        "start_timeout": MCP_START_TIMEOUT_S,
                        "env": env,
                    }
                    for index, module in enumerate(modules)
                ]
            },
            shutdown={"kill_grace": grace},
        )
        self.daemon.env = {MARKER_VAR: marker}
        self.store: Store | None = None
        self.boot_id = ""
        self.members: list[Member] = []

    @property
    def mcp_count(self) -> int:
        return WORKERS * len(self.modules)

    @property
    def spawner_count(self) -> int:
        return WORKERS * self.modules.count("spawner")  # each writes one pid to each file

    # --- start ----------------------------------------------------------------------

    def start(self) -> float:
        """Start the daemon and wait for the whole tree; returns the seconds it took."""
        started = time.monotonic()
        self.daemon.start(wait=False)
        proc = self.daemon.proc
        assert proc is not None

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the daemon exited while starting:\n{self.daemon.log()[-3000:]}"
                )
            return self.daemon.ready_count() >= 1

        wait_for(ready, STARTUP_TIMEOUT_S, "the daemon to be ready")
        self.store = Store(self.daemon.url, migrate=False)
        self.boot_id = self.store.boots.recent(1)[0].boot_id
        remaining = max(1.0, STARTUP_TIMEOUT_S - (time.monotonic() - started))
        wait_for(self._tree_up, remaining, f"{self.mcp_count} live MCP servers")
        return time.monotonic() - started

    def _tree_up(self) -> bool:
        assert self.store is not None
        rows = [c for c in self.store.children.of_boot(self.boot_id) if c.kind == "mcp"]
        if len(rows) != self.mcp_count:
            return False
        if not all(_alive(ProcessId(c.pid, c.create_time)) for c in rows):
            return False
        return all(len(_read_pids(path)) >= self.spawner_count for path in self.pid_files.values())

    def snapshot(self) -> list[Member]:
        """Every process of the tree now, by kind."""
        assert self.store is not None
        rows = self.store.children.of_boot(self.boot_id)
        members: dict[int, Member] = {}
        daemon = ProcessId.of(self.daemon.pid)
        if daemon is not None:
            members[daemon.pid] = Member("daemon", daemon)
        for row in rows:
            members[row.pid] = Member(row.kind, ProcessId(row.pid, row.create_time), row.worker)
        for path in self.pid_files.values():
            for pid in _read_pids(path):
                if pid not in members and (found := ProcessId.of(pid)) is not None:
                    members[pid] = Member("grandchild", found)
        groups = [row.pgid for row in rows if row.pgid]
        for proc in descendants(self.daemon.pid, groups):
            if proc.pid not in members and (found := ProcessId.of(proc.pid)) is not None:
                members[proc.pid] = Member("other", found)
        self.members = list(members.values())
        return self.members

    def survivors(self) -> list[Member]:
        return [m for m in self.members if _alive(m.pid)]

    def stop_log(self) -> dict[str, Any]:
        """What the daemon logged about its stop."""
        log = self.daemon.log()
        marks: dict[str, Any] = {}
        if found := _STOPPED.findall(log):
            total, seconds, termed, killed, survived = found[-1]
            marks.update(
                descendants=int(total),
                descendants_stopped_s=float(seconds),
                exited_on_sigterm=int(termed),
                needed_sigkill=int(killed),
                survived=int(survived or 0),
            )
        if found := _STOPPED_CLEANLY.findall(log):
            marks["daemon_reported_stop_s"] = float(found[-1])
        return marks

    def shutdown_log(self, lines: int = 60) -> list[str]:
        """The daemon's log from its last "received SIGTERM" on (the workers log there too)."""
        log = self.daemon.log()
        at = log.rfind("received SIGTERM")
        if at < 0:
            return []
        start = log.rfind("\n", 0, at) + 1
        return [line[:220] for line in log[start:].splitlines()[:lines]]

    # --- cleanup --------------------------------------------------------------------

    def close(self) -> list[dict[str, Any]]:
        """SIGKILL whatever of this tree is left, by pid; returns what was still alive."""
        left: list[dict[str, Any]] = []
        try:
            for member in self.members:
                if _alive(member.pid) and (proc := member.pid.process()) is not None:
                    left.append({"kind": member.kind, **_describe(member.pid.pid)})
                    with contextlib.suppress(psutil.Error):
                        proc.send_signal(signal.SIGCONT)
                        proc.kill()
            daemon = self.daemon.proc
            if daemon is not None and daemon.poll() is None:
                self.daemon.kill_everything()
            seen = {entry["pid"] for entry in left}
            left.extend(e for e in kill_marked(self.marker) if e["pid"] not in seen)
        finally:
            if self.store is not None:
                self.store.close()
                self.store = None
        return left


def wait_exit(proc: subprocess.Popen[bytes], fd: int, timeout: float) -> float | None:
    """Wait on a pidfd for the exit of `proc`; returns the monotonic time, None on timeout."""
    readable, _, _ = select.select([fd], [], [], timeout)
    if not readable:
        return None
    now = time.monotonic()
    proc.wait()
    return now


def parallel_run(root: Path, name: str, grace: float, target_s: float) -> dict[str, Any]:
    """One start and SIGTERM of tree `name`, measured."""
    marker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tree = Tree(root, TREES[name], marker, grace)
    result: dict[str, Any] = {}
    try:
        result["startup_s"] = tree.start()
        members = tree.snapshot()
        result["tree"] = dict(sorted(Counter(m.kind for m in members).items()))
        time.sleep(SETTLE_S)
        proc = tree.daemon.proc
        assert proc is not None
        fd = os.pidfd_open(proc.pid)
        try:
            began = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
            ended = wait_exit(proc, fd, EXIT_TIMEOUT_S)
        finally:
            os.close(fd)
        result["stop_s"] = None if ended is None else ended - began
        result["exit_code"] = proc.returncode
        alive = tree.survivors()
        result["alive_after_exit"] = dict(sorted(Counter(m.kind for m in alive).items()))
        result["alive_after_exit_total"] = len(alive)
        result.update(tree.stop_log())
        stop_s = result["stop_s"]
        if stop_s is None or stop_s > target_s or alive or result.get("survived"):
            result["shutdown_log"] = tree.shutdown_log()
    except Exception as exc:  # reported; the other runs go on
        result["error"] = repr(exc)[:2000]
    finally:
        result["leftovers"] = tree.close()
    return result


def sequential_run(root: Path, grace: float) -> dict[str, Any]:
    """The stubborn tree stopped one process at a time, each with `grace` before SIGKILL."""
    marker = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tree = Tree(root, TREES["stubborn"], marker, grace)
    result: dict[str, Any] = {}
    try:
        result["startup_s"] = tree.start()
        members = tree.snapshot()
        result["tree"] = dict(sorted(Counter(m.kind for m in members).items()))
        time.sleep(SETTLE_S)
        by_kind = {kind: [m for m in members if m.kind == kind] for kind in ("daemon", "worker")}
        # Freeze the supervisors so that no one restarts what is stopped.
        for member in by_kind["daemon"] + by_kind["worker"]:
            if (proc := member.pid.process()) is not None:
                proc.send_signal(signal.SIGSTOP)
        order = ["mcp", "grandchild", "worker", "daemon"]
        steps: dict[str, dict[str, Any]] = {k: {"count": 0, "killed": 0, "s": 0.0} for k in order}
        ignoring = {"count": 0, "s": 0.0}
        rest_s = 0.0
        began = time.monotonic()
        for kind in order:
            for member in (m for m in members if m.kind == kind):
                proc = member.pid.process()
                if proc is None:
                    continue
                report = terminate([proc], grace)
                steps[kind]["count"] += 1
                steps[kind]["killed"] += len(report.killed) + len(report.survivors)
                steps[kind]["s"] += report.seconds
                if report.killed or report.survivors:
                    ignoring["count"] += 1
                    ignoring["s"] += report.seconds
                else:
                    rest_s += report.seconds
        result["measured_s"] = time.monotonic() - began
        # `terminate` reaped the daemon (our child): no exit status is left to report.
        daemon = tree.daemon.proc
        assert daemon is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.wait(timeout=EXIT_TIMEOUT_S)
        result["steps"] = {k: {**v, "s": round(v["s"], 3)} for k, v in steps.items() if v["count"]}
        stubborn_per_worker = sum(m in IGNORES_SIGTERM for m in tree.modules)
        expected_ignoring = WORKERS * stubborn_per_worker
        result["computed"] = {
            "ignore_sigterm": expected_ignoring,
            "ignore_sigterm_measured": ignoring["count"],
            "grace_s": grace,
            "rest_measured_s": round(rest_s, 3),
            "computed_s": round(expected_ignoring * grace + rest_s, 3),
            "formula": "ignore_sigterm x grace + rest_measured_s",
        }
        alive = tree.survivors()
        result["alive_after_exit"] = dict(sorted(Counter(m.kind for m in alive).items()))
        result["alive_after_exit_total"] = len(alive)
        result["daemon_log"] = tree.stop_log()
    except Exception as exc:  # reported
        result["error"] = repr(exc)[:2000]
    finally:
        result["leftovers"] = tree.close()
    return result


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def summarize(runs: list[dict[str, Any]], target_s: float) -> dict[str, Any]:
    stops = [r["stop_s"] for r in runs if r.get("stop_s") is not None]
    return {
        "target_s": target_s,
        "stop_s": stats_s(stops),
        "within_target": sum(s <= target_s for s in stops),
        "startup_s": stats_s([r["startup_s"] for r in runs if "startup_s" in r]),
        "alive_after_exit_total": sum(r.get("alive_after_exit_total", 0) for r in runs),
        "leftovers": [e for r in runs for e in r.get("leftovers", [])],
        "runs": [_round({k: v for k, v in r.items() if k != "leftovers"}) for r in runs],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.bench_shutdown")
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help=f"runs of each tree (default {DEFAULT_RUNS})",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RUNS} run of each tree")
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help=f"seconds; no new pair of runs starts past it (default {BUDGET_S:g})",
    )
    args = parser.parse_args(argv)
    runs = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    grace = KILL_GRACE
    targets = {"stubborn": grace + 1.0, "well_behaved": WELL_BEHAVED_TARGET_S}

    started = time.monotonic()
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in TREES}
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="tk-bench-shutdown-") as tmp:
        sequential = sequential_run(Path(tmp) / "sequential", grace)
        longest_pair = 0.0
        # Alternate the trees so that they share the machine's state.
        for index in range(runs):
            elapsed = time.monotonic() - started
            if index > 0 and elapsed + longest_pair > args.budget:
                skipped = runs - index
                break
            pair_started = time.monotonic()
            for name in TREES:
                root = Path(tmp) / f"{name}-{index}"
                measured[name].append(parallel_run(root, name, grace, targets[name]))
            longest_pair = max(longest_pair, time.monotonic() - pair_started)

    stubborn = summarize(measured["stubborn"], targets["stubborn"])
    well_behaved = summarize(measured["well_behaved"], targets["well_behaved"])
    stubborn_median = stubborn["stop_s"]["median"]
    sequential_summary = _round(dict(sequential))
    if stubborn_median and "measured_s" in sequential:
        sequential_summary["ratio_to_parallel_median"] = round(
            sequential["measured_s"] / stubborn_median, 1
        )
    result: dict[str, Any] = {
        "benchmark": "shutdown",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "kill_grace": grace,
        "workers": WORKERS,
        "mcp_servers_per_worker": {name: modules for name, modules in TREES.items()},
        "runs": runs,
        "runs_skipped_for_budget": skipped,
        "budget_s": args.budget,
        "stubborn": stubborn,
        "well_behaved": well_behaved,
        "sequential_estimate": sequential_summary,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
