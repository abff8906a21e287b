"""The pool's dealings with the OS about its processes: signals, exit statuses,
multiprocess's resource tracker, and how a slot and its worker are shown."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

import multiprocess
import multiprocess.resource_tracker

from supervisor.core.slots import Slot
from supervisor.pool.ownership import WorkerHandle


def resource_tracker() -> int | None:
    """The pid of multiprocess's resource tracker, a helper process that spawn starts."""
    tracker = getattr(multiprocess.resource_tracker, "_resource_tracker", None)
    pid = getattr(tracker, "_pid", None)
    return pid if isinstance(pid, int) else None


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
