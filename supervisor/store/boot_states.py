"""How a recorded boot stands: its outcome, else whether its process still runs.

Shared by `turnkeeper boots` (which reads the database directly, daemon up or down) and
`GET /v1/boots` (the console), so both judge a boot alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from supervisor.contract.clock import SYSTEM
from supervisor.store.boots import Boot

RUNNING, CRASHED, UNKNOWN = "running", "crashed", "unknown"  # states with no outcome recorded
CLOCK_SLACK = 2.0  # seconds: a boot's process starts before its row; the clocks may differ


def boot_state(boot: Boot, host: str, running: Callable[[Boot], bool]) -> str:
    """How a boot stands: its recorded outcome, else whether its process still runs."""
    if boot.outcome is not None:
        return boot.outcome
    if boot.host != host:
        return UNKNOWN  # its process is on another machine: this one cannot look
    return RUNNING if running(boot) else CRASHED


def process_check(db_now: float) -> Callable[[Boot], bool]:
    """Whether a boot of this host still runs: its pid is a live process (not a zombie)
    that was started before the boot's row was written, so a reused pid does not count.

    The row's time is the database's clock; `db_now` (read just now) maps it to ours.
    """
    import psutil

    skew = db_now - SYSTEM.time()

    def running(boot: Boot) -> bool:
        try:
            proc = psutil.Process(boot.pid)
            started = proc.create_time()
            return proc.status() != psutil.STATUS_ZOMBIE and (
                started <= boot.started_at - skew + CLOCK_SLACK
            )
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # another user's live process: it exists

    return running


def boot_json(boot: Boot, state: str) -> dict[str, Any]:
    """A boot and its state, as `turnkeeper boots --json` and `GET /v1/boots` give it."""
    return {
        "boot_id": boot.boot_id,
        "host": boot.host,
        "pid": boot.pid,
        "version": boot.version,
        "started_at": boot.started_at,
        "ended_at": boot.ended_at,
        "outcome": boot.outcome,
        "state": state,
        "breaker": boot.breaker,
        "attempted": boot.attempted,
    }
