"""The teardown budget: every step of a stop as it runs, each at its cap, and their sum
(pure: a configuration in, seconds out).

A stop (SIGTERM; docs/architecture.md, "The stop") stops the services in reverse start
order, one step after the other, each step capped. The budget is its worst case, every
step at its cap; systemd's `TimeoutStopSec` and supervisord's `stopwaitsecs` must be above
it, or the service manager SIGKILLs the daemon in the middle of its stop. `turnkeeper
doctor` checks it against them, `turnkeeper config show` prints it, and the daemon counts
on it for how long a restart in place may take. The caps are the ones below, which the
services stop with (the HTTP listener's margin and the task starts' wait are the HTTP and
task services' own, and tests hold them to these):

    step                 cap                          runs
    drain                shutdown.drain_budget        when above 0 (`stop --drain`: its own)
    http listener        attach.shutdown_timeout + 1  always
    courier              1                            always: deliveries given back
    task starts          5                            while a task's runner is starting
    subagent check       2                            when shutdown.subagent_drain is above 0
    subagent drain       shutdown.subagent_drain + 1  while a subagent's turn is in flight
    descendants          shutdown.kill_grace + 1.5    always: SIGTERM, SIGKILL, reaped
    wake listener        2                            on PostgreSQL
    peer deregistration  2                            always
    boot row             5                            always
    telemetry flush      3                            when telemetry.otlp_endpoint is set

Not counted: the services whose stop only cancels their loops, and the few single
statements without a cap of their own (the subagents' claims given up, the database
closed). Tracing turned on by `OTEL_EXPORTER_OTLP_ENDPOINT` alone (the key empty) adds
its flush too, which this budget, read from the configuration only, does not count. A
background task's runner is one of the descendants: it gets SIGTERM with them
and SIGKILL at `shutdown.kill_grace`, so `tasks.kill_grace` does not lengthen a stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from supervisor.contract.config import Config

LISTENER_MARGIN = 1.0  # beyond attach.shutdown_timeout: the HTTP listener's close
COURIER = 1.0  # deliveries in flight cancelled, their claims given back
TASK_STARTS = 5.0  # runners being started are waited for, to be stopped with the others
SUBAGENT_CHECK = 2.0  # the read that decides whether a subagent drain is needed
SUBAGENT_MARGIN = 1.0  # beyond shutdown.subagent_drain: its last read
REAP_BOUND = 1.5  # beyond shutdown.kill_grace: SIGKILL and reaping
WAKE_LISTENER = 2.0  # PostgreSQL's wake listener (a thread) joined
PEER_DEREGISTRATION = 2.0  # this host's row left: the others adopt its sessions at once
BOOT_ROW = 5.0  # the boot row ended with the outcome and the step durations
TELEMETRY_FLUSH = "telemetry flush"
FLUSH_CAP = 3.0  # seconds: the stop's telemetry flush

# systemd/turnkeeper.service's TimeoutStopSec and etc/supervisord/turnkeeper.conf's
# stopwaitsecs (tests/lifecycle/test_deploy.py holds them to it).
SHIPPED_STOP_TIMEOUT = 45.0


@dataclass(frozen=True)
class Step:
    """One step of a stop at its cap: `name` as the stop's log names it, `setting` the key
    that sets its cap ("" for a fixed one), `note` how the cap is made up."""

    name: str
    seconds: float
    setting: str = ""
    note: str = ""

    def line(self) -> str:
        return f"{self.name}: {self.seconds:g} s" + (f" ({self.note})" if self.note else "")


@dataclass(frozen=True)
class Budget:
    """The capped steps of a stop, in the order they run, and their sum in seconds."""

    steps: tuple[Step, ...]

    @property
    def total(self) -> float:
        return sum(step.seconds for step in self.steps)

    def seconds(self, name: str) -> float:
        """The cap of the step `name`; 0 for a step this configuration never runs."""
        return next((step.seconds for step in self.steps if step.name == name), 0.0)

    def settings(self) -> list[str]:
        """The keys that lengthen it, the longest step's first."""
        steps = sorted(self.steps, key=lambda step: -step.seconds)
        return [step.setting for step in steps if step.setting]

    def lines(self) -> list[str]:
        """A readable breakdown: a line a step, then the total."""
        return [*(step.line() for step in self.steps), f"total: {self.total:g} s"]


def teardown_budget(config: Config, drain: float | None = None) -> Budget:
    """The worst case of a stop under `config`; `drain` overrides `shutdown.drain_budget`
    (0: a stop without the drain, as a restart's after its own)."""
    shutdown = config.shutdown
    drain = shutdown.drain_budget if drain is None else drain
    steps = [
        Step("drain", drain, "shutdown.drain_budget", "shutdown.drain_budget"),
        Step(
            "http listener",
            config.attach.shutdown_timeout + LISTENER_MARGIN,
            "attach.shutdown_timeout",
            f"attach.shutdown_timeout + {LISTENER_MARGIN:g}",
        ),
        Step("courier", COURIER, note="deliveries in flight given back"),
        Step("task starts", TASK_STARTS, note="runners being started"),
    ]
    if shutdown.subagent_drain > 0:
        steps += [
            Step("subagent check", SUBAGENT_CHECK, note="subagent turns in flight read"),
            Step(
                "subagent drain",
                shutdown.subagent_drain + SUBAGENT_MARGIN,
                "shutdown.subagent_drain",
                f"shutdown.subagent_drain + {SUBAGENT_MARGIN:g}",
            ),
        ]
    steps.append(
        Step(
            "descendants",
            shutdown.kill_grace + REAP_BOUND,
            "shutdown.kill_grace",
            f"shutdown.kill_grace + {REAP_BOUND:g} to reap",
        )
    )
    if urlsplit(config.store.url).scheme in ("postgres", "postgresql"):
        steps.append(Step("wake listener", WAKE_LISTENER, note="PostgreSQL"))
    steps += [Step("peer deregistration", PEER_DEREGISTRATION), Step("boot row", BOOT_ROW)]
    if config.telemetry.otlp_endpoint:
        steps.append(Step(TELEMETRY_FLUSH, FLUSH_CAP, note="spans queued for export"))
    return Budget(tuple(step for step in steps if step.seconds > 0))


def check_stop_timeout(budget: Budget, stop_timeout: float, what: str) -> str | None:
    """A problem statement naming both numbers and what to change if `stop_timeout` (the
    service manager's, `what`) is not above the budget, else None."""
    if stop_timeout > budget.total:
        return None
    keys = budget.settings()
    lower = ", ".join(keys[:-1]) + f" or {keys[-1]}" if len(keys) > 1 else "".join(keys)
    return (
        f"{what} is {stop_timeout:g} s, not above the teardown budget of {budget.total:g} s: "
        f"raise it to at least {int(budget.total) + 5} s" + (f", or lower {lower}" if lower else "")
    )
