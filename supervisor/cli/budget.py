"""The stop sequence's worst case, computed from the configuration (pure).

systemd's `TimeoutStopSec` (or supervisord's `stopwaitsecs`) must be above it, or the
service manager SIGKILLs the daemon in the middle of its teardown.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.contract.config import Config

# Beyond shutdown.kill_grace: SIGKILL, reaping, ending the boot row, closing the store.
REAP_AND_CLOSE = 2.0
SHIPPED_STOP_TIMEOUT = 30.0  # TimeoutStopSec of systemd/turnkeeper.service


@dataclass(frozen=True)
class Budget:
    """The capped steps of a stop and their sum, in seconds."""

    steps: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return sum(seconds for _, seconds in self.steps)

    def lines(self) -> list[str]:
        """A readable breakdown."""
        rows = [f"{name}: {seconds:g} s" for name, seconds in self.steps]
        return [*rows, f"total: {self.total:g} s"]


def teardown_budget(config: Config, drain: float | None = None) -> Budget:
    """The worst-case stop time; `drain` overrides `shutdown.drain_budget`."""
    drain = config.shutdown.drain_budget if drain is None else drain
    steps = [
        ("drain", drain),
        ("http listener (attach.shutdown_timeout)", config.attach.shutdown_timeout),
        ("subagent drain (shutdown.subagent_drain)", config.shutdown.subagent_drain),
        ("descendants (shutdown.kill_grace)", config.shutdown.kill_grace),
        ("reap, boot row, close", REAP_AND_CLOSE),
    ]
    return Budget(tuple((name, seconds) for name, seconds in steps if seconds > 0))


def check_stop_timeout(budget: Budget, stop_timeout: float, what: str) -> str | None:
    """A problem statement if `stop_timeout` is not above the budget, else None."""
    if stop_timeout > budget.total:
        return None
    return (
        f"{what} is {stop_timeout:g} s, not above the teardown budget of {budget.total:g} s: "
        f"raise it to at least {int(budget.total) + 5} s, or lower shutdown.kill_grace, "
        "attach.shutdown_timeout, shutdown.subagent_drain or shutdown.drain_budget"
    )
