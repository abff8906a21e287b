"""What the benchmarks share: percentiles, latency summaries, waiting on a condition, the
shipped pool, and the daemon's processes (a port, CPU time, liveness, a stop)."""

from __future__ import annotations

import contextlib
import signal
import socket
import statistics
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import psutil

from supervisor.contract.config import PoolConfig

if TYPE_CHECKING:
    from tests.daemon import Daemon

T = TypeVar("T")
POLL_S = 0.05
STOP_TIMEOUT_S = 30.0


def percentile(sorted_values: list[float], p: float) -> float:
    """The nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(p / 100 * len(sorted_values)) - 1))
    return sorted_values[rank]


def stats_ms(values_ms: list[float]) -> dict[str, float | int | None]:
    """n, min, p50, p99, max and mean of latencies in milliseconds."""
    ordered = sorted(values_ms)
    if not ordered:
        return {"n": 0, "min": None, "p50": None, "p99": None, "max": None, "mean": None}
    return {
        "n": len(ordered),
        "min": round(ordered[0], 1),
        "p50": round(percentile(ordered, 50), 1),
        "p99": round(percentile(ordered, 99), 1),
        "max": round(ordered[-1], 1),
        "mean": round(statistics.fmean(ordered), 1),
    }


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `predicate` until it returns something truthy; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_S)


def log_time(stamp: str) -> float:
    """A daemon log timestamp (local time, milliseconds) as epoch seconds."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def shipped_pool(workers: int | None = None, spare: int | None = None) -> dict[str, Any]:
    """The `pool` section with the shipped timings (`PoolConfig()`), and its sizes unless
    given."""
    shipped = PoolConfig()
    return {
        "workers": shipped.workers if workers is None else workers,
        "spare": shipped.spare if spare is None else spare,
        "heartbeat_interval": shipped.heartbeat_interval,
        "hang_timeout": shipped.hang_timeout,
    }


# --- processes ---------------------------------------------------------------------


def free_port() -> int:
    """A loopback TCP port free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_s(proc: psutil.Process | int) -> float | None:
    """User + system CPU seconds of one process (not its children); None once it is gone."""
    try:
        process = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        times = process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return float(times.user + times.system)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop(daemon: Daemon, timeout: float = STOP_TIMEOUT_S) -> float | None:
    """SIGTERM and wait; SIGKILL whatever is left, by pid. Seconds to a clean stop."""
    started = time.monotonic()
    clean: float | None = None
    try:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.signal(signal.SIGTERM)
            with contextlib.suppress(Exception):
                daemon.wait(timeout)
                clean = round(time.monotonic() - started, 2)
    finally:
        daemon.kill_everything()
    return clean
