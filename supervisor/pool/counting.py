"""What the pool counts in: the metrics are a service the pool is given (by the
composition root), not a module it imports. `supervisor.metrics.Metrics` is one."""

from __future__ import annotations

from typing import Any, Protocol


class Counts(Protocol):
    """The pool's, recovery's and the host row's metrics (prometheus_client objects)."""

    model_tokens: Any  # Counter{kind}
    model_errors: Any  # Counter{kind}
    append_latency: Any  # the workers' append latency, added from heartbeats
    first_delta: Any  # Histogram: a model call's time to its first delta
    deltas_dropped: Any  # Counter{where}
    spans_dropped: Any  # the spans the workers could not export, added from heartbeats
    breaker_tripped: Any  # Gauge
    recovery: Any  # Counter{action, cause, outcome}
    recovery_age: Any  # Histogram
    recovery_refunds: Any  # Counter
    subagent_recovery: Any  # Counter{action}
    shutdown_steps: Any  # Gauge{step}

    def loop_pass(self, loop: str, ok: bool) -> None:
        """One pass of a reconcile loop."""
