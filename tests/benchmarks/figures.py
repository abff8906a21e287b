"""What the benchmarks share: percentiles, latency summaries, and waiting on a condition."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
POLL_S = 0.05


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
