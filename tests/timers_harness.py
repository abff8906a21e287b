"""What the timer tests and the timers benchmark share: a real daemon restarted each way an
operator restarts one, a cron expression for one moment, and a task runner that dies."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import UTC, datetime

import psutil

from supervisor.store import TaskInfo
from tests.daemon import Daemon, wait_until

WAYS = ("in place", "SIGTERM", "SIGKILL")
SLEEPER = {"name": "sleeper", "command": ["sleep", "600"]}  # a task that runs until stopped


def restart(daemon: Daemon, way: str, timeout: float = 60.0) -> float:
    """Restart `daemon` the `way` given (`WAYS`: a requested restart in place with the
    default drain, SIGTERM and a new start, SIGKILL of the supervisor and a new start);
    the time (epoch seconds) its new boot answered ready."""
    boot = daemon.status()["boot"]["id"]
    if way == "in place":
        with daemon.client() as http:
            http.post("/v1/restart", json={"reason": "timers"}).raise_for_status()

        def new_boot() -> bool:
            with contextlib.suppress(Exception):  # between two boots
                return daemon.ready() and daemon.status()["boot"]["id"] != boot
            return False

        wait_until(new_boot, timeout, "the new boot")
    else:
        daemon.signal(signal.SIGTERM if way == "SIGTERM" else signal.SIGKILL)
        daemon.wait(timeout)
        daemon.start()
    return time.time()


def in_utc(moment: float) -> str:
    """A 6-field cron expression for one moment (a whole second) of the year, in UTC."""
    t = datetime.fromtimestamp(moment, UTC)
    return f"{t.second} {t.minute} {t.hour} {t.day} {t.month} *"


def kill_runner(task: TaskInfo) -> None:
    """SIGKILL a task's runner and its command (each leads a group of its own), and wait
    until its daemon has reaped the runner."""
    assert task.runner_pid is not None
    runner = psutil.Process(task.runner_pid)
    groups = {os.getpgid(p.pid) for p in [runner, *runner.children(recursive=True)]}
    for group in groups:
        os.killpg(group, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(runner.pid), 10, "the runner's end")
