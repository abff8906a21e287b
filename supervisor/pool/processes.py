"""The pool's dealings with the OS about its processes: signals, exit statuses, hung
workers, multiprocess's resource tracker, and how a slot and its worker are shown."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from typing import Any, Protocol

import multiprocess
import multiprocess.resource_tracker

from supervisor.contract.logs import log
from supervisor.contract.mcp_env import child_environment
from supervisor.core.slots import Slot
from supervisor.pool.handle import WorkerHandle

START_TIMEOUT = 30.0  # a worker that has not said it is ready by then is hung
ABORT_GRACE = 1.0  # between SIGABRT (traceback) and SIGKILL for a hung worker
# Heartbeat intervals a worker silent past `pool.hang_timeout` is given to be heard from
# before it is aborted: the silence may be the supervisor's own (it was stopped).
CONFIRM_HEARTBEATS = 2
CONFIRM_MIN = 1.0  # ... and seconds at least: processes thawed one by one


def resource_tracker() -> int | None:
    """The pid of multiprocess's resource tracker, a helper process that spawn starts."""
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


# What the tracker (a Python process of its own) needs beyond an MCP server's few variables.
TRACKER_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH")


def start_resource_tracker() -> None:
    """Start multiprocess's resource tracker now, with an MCP server's environment: it
    would otherwise start with the first worker and inherit the daemon's whole environment,
    secrets included (a delivery target's key, a model's API key), readable for as long as
    it runs in its `/proc/PID/environ`. The environment is swapped for the moment of the
    start: call it while the process has one thread (the daemon does, first thing), since
    another thread reading the environment meanwhile (libpq does, connecting) can crash
    the process. Once it runs, a call does nothing."""
    if resource_tracker() is not None:
        return
    kept = dict(os.environ)
    env = child_environment({name: kept[name] for name in TRACKER_ENV if name in kept})
    try:
        os.environ.clear()
        os.environ.update(env)
        multiprocess.resource_tracker.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(kept)


def stop_resource_tracker() -> None:
    # It ignores SIGTERM by design and exits when every holder of its pipe (we and the
    # workers) has closed it; with the workers gone, closing ours ends it, and _stop reaps it.
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    with contextlib.suppress(Exception):
        tracker._stop()  # type: ignore[union-attr]


def describe_exit(code: int | None, requested: bool = False) -> str:
    """An exit status in words, to follow "exited with" in the log: "code 0", "signal
    SIGKILL". No status (None) means another waiter reaped the worker first: during a stop
    or a rolling restart (`requested`), the reaper that stops every descendant."""
    if code is None:
        return (
            "the stop (its status went to the stop's reaper)"
            if requested
            else "a status reaped elsewhere"
        )
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class Timing(Protocol):
    """How often a worker beats and how long a silence may be (`pool.*`)."""

    @property
    def heartbeat_interval(self) -> float: ...

    @property
    def hang_timeout(self) -> float: ...


def check_hangs(workers: Iterable[WorkerHandle], now: float, pool: Timing | None = None) -> float:
    """Abort the workers silent for longer than `pool.hang_timeout` and still silent
    `CONFIRM_HEARTBEATS` intervals after that was first seen: SIGABRT (its traceback goes
    to the log), and SIGKILL `ABORT_GRACE` later, again every `ABORT_GRACE` until it is
    gone. Without `pool`, each worker is judged by its own interval and timeout (those
    it was started with). Returns the time of the next check it needs."""
    next_check = float("inf")
    for worker in list(workers):
        timing = worker if pool is None else pool
        if not worker.alive or worker.stop_requested:
            continue
        if worker.aborted_at is not None:
            killed_at = worker.aborted_at + ABORT_GRACE
            if now >= killed_at:
                send_signal(worker.pid, signal.SIGKILL)
            next_check = min(next_check, killed_at if now < killed_at else now + ABORT_GRACE)
            continue
        hang = timing.hang_timeout
        limit = hang if worker.ready else max(hang, START_TIMEOUT)
        silent = now - worker.last_heartbeat
        confirm = max(CONFIRM_HEARTBEATS * timing.heartbeat_interval, CONFIRM_MIN)
        suspected = worker.suspected_at
        if silent > limit and (suspected is None or suspected < worker.last_heartbeat):
            # Silent past its limit, as far as the supervisor can tell: but the supervisor
            # itself may just have been stopped (a paused host, a frozen cgroup) with its
            # workers, whose heartbeats arrive once they all run again. Look once more.
            worker.suspected_at = now
            next_check = min(next_check, now + confirm)
        elif silent > limit and suspected is not None and now < suspected + confirm:
            next_check = min(next_check, suspected + confirm)
        elif silent > limit:
            log("pool").error(
                "worker {} sent no heartbeat for {:.1f} s: hung; aborting it",
                worker.identity,
                silent,
            )
            worker.aborted_at = now
            send_signal(worker.pid, signal.SIGABRT)
            next_check = min(next_check, now + ABORT_GRACE)
        else:
            next_check = min(next_check, worker.last_heartbeat + limit)
    return next_check


def send_signal(pid: int, signum: int) -> None:
    """Signal a process that may have exited already."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def slot_status(slot: Slot, worker: WorkerHandle | None) -> dict[str, Any]:
    """One slot and its worker, as /v1/status and `turnkeeper status` show them."""
    return {
        "slot": slot.index,
        "state": slot.state.value,
        "worker": worker.identity if worker else None,
        "pid": worker.pid if worker else None,
        "ready": bool(worker and worker.ready),
        "spare": bool(worker and worker.spare),
        "sessions": len(worker.sessions) if worker else 0,
        "turns": worker.turns if worker else 0,  # in flight
        "turns_served": worker.turns_served if worker else 0,
        "mcp": [{"name": n, "state": s} for n, s in worker.mcp.items()] if worker else [],
    }
