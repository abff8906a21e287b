"""Prometheus metrics, served by the supervisor from one registry.

Workers do not write metric files: what they do reaches the supervisor over the control
plane (every committed event), and the pool's own state is read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _PoolCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        status = self._snapshot()
        restarts = CounterMetricFamily(
            "turnkeeper_worker_restarts", "Worker processes that died without being asked to."
        )
        restarts.add_metric([], status.get("restarts", 0))
        yield restarts
        workers = GaugeMetricFamily(
            "turnkeeper_workers", "Worker slots by state.", labels=["state"]
        )
        counts: dict[str, int] = {}
        for slot in status.get("slots", []):
            counts[slot["state"]] = counts.get(slot["state"], 0) + 1
        for state in ("starting", "running", "backoff", "fatal", "stopped"):
            workers.add_metric([state], counts.get(state, 0))
        yield workers


class Metrics:
    """The daemon's metrics."""

    def __init__(self, pool_status: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.events_committed = Counter(
            "turnkeeper_events_committed",
            "Events committed, by type.",
            ["type"],
            registry=self.registry,
        )
        self.intake_rejections = Counter(
            "turnkeeper_intake_rejections",
            "Requests intake refused, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.registry.register(_PoolCollector(pool_status))

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
