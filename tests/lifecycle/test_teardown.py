"""The teardown budget (`supervisor.teardown`): every step of a stop at its cap, and their
sum, from the configuration alone; and the caps the services stop with are its own."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from supervisor import teardown
from supervisor.contract.config import Config
from supervisor.deliveries import service as deliveries
from supervisor.http.service import HttpService
from supervisor.pool import drain
from supervisor.pool.membership import Membership
from supervisor.pool.pool import Pool
from supervisor.subagents.service import Reconciler
from supervisor.tasks.service import TaskKeeper
from supervisor.teardown import check_stop_timeout, teardown_budget


def config(**sections: dict[str, Any]) -> Config:
    return Config.model_validate(sections)


def test_the_defaults_add_up_every_step_at_its_cap() -> None:
    budget = teardown_budget(Config())
    assert [(step.name, step.seconds) for step in budget.steps] == [
        ("http listener", 6.0),
        ("courier", 1.0),
        ("task starts", 5.0),
        ("subagent check", 2.0),
        ("subagent drain", 6.0),
        ("descendants", 4.5),
        ("peer deregistration", 2.0),
        ("boot row", 5.0),
    ]
    assert budget.total == 31.5
    assert budget.lines() == [
        "http listener: 6 s (attach.shutdown_timeout + 1)",
        "courier: 1 s (deliveries in flight given back)",
        "task starts: 5 s (runners being started)",
        "subagent check: 2 s (subagent turns in flight read)",
        "subagent drain: 6 s (shutdown.subagent_drain + 1)",
        "descendants: 4.5 s (shutdown.kill_grace + 1.5 to reap)",
        "peer deregistration: 2 s",
        "boot row: 5 s",
        "total: 31.5 s",
    ]
    # Under the shipped stop timeout, with room for the steps that have no cap of their own.
    assert budget.total + 10 <= teardown.SHIPPED_STOP_TIMEOUT


def test_each_setting_moves_its_own_step() -> None:
    base = teardown_budget(Config())
    changed = teardown_budget(
        config(
            shutdown={"kill_grace": 10.0, "drain_budget": 20.0, "subagent_drain": 7.0},
            attach={"shutdown_timeout": 2.0},
        )
    )
    assert changed.seconds("drain") == 20.0 and base.seconds("drain") == 0.0
    assert changed.seconds("http listener") == 3.0
    assert changed.seconds("subagent drain") == 8.0
    assert changed.seconds("descendants") == 11.5
    assert changed.total == base.total + 20 - 3 + 2 + 7
    assert changed.steps[0].name == "drain"  # first, as it runs: before the listener closes
    # The settings named to lower, the longest step's first.
    assert changed.settings() == [
        "shutdown.drain_budget",
        "shutdown.kill_grace",
        "shutdown.subagent_drain",
        "attach.shutdown_timeout",
    ]
    # `drain` stands for the stop's own (`turnkeeper stop --drain`, a restart's: 0).
    assert teardown_budget(Config(), drain=20.0).total == base.total + 20
    assert teardown_budget(config(shutdown={"drain_budget": 20.0}), drain=0.0) == base


def test_steps_that_never_run_are_not_counted() -> None:
    # No subagent drain: neither its read nor its wait.
    off = teardown_budget(config(shutdown={"subagent_drain": 0}))
    assert "subagent check" not in [s.name for s in off.steps]
    assert off.seconds("subagent drain") == 0.0
    assert off.total == teardown_budget(Config()).total - 8
    # The wake listener (a thread of its own) runs on PostgreSQL only.
    for url in ("postgresql://tk@db/tk", "postgres://tk@db/tk"):
        assert teardown_budget(config(store={"url": url})).seconds("wake listener") == 2.0
    for url in ("", "sqlite:////var/lib/tk.db", "mysql://tk@db/tk"):
        assert teardown_budget(config(store={"url": url})).seconds("wake listener") == 0.0


def test_a_stop_timeout_not_above_the_budget_names_both_numbers_and_the_keys() -> None:
    budget = teardown_budget(config(shutdown={"drain_budget": 20.0}))
    assert budget.total == 51.5
    problem = check_stop_timeout(budget, 45, "TimeoutStopSec")
    assert problem == (
        "TimeoutStopSec is 45 s, not above the teardown budget of 51.5 s: raise it to at "
        "least 56 s, or lower shutdown.drain_budget, attach.shutdown_timeout, "
        "shutdown.subagent_drain or shutdown.kill_grace"
    )
    assert check_stop_timeout(budget, 51.5, "TimeoutStopSec") is not None
    assert check_stop_timeout(budget, 52, "TimeoutStopSec") is None


# --- the services stop with the budget's caps ------------------------------------------


class Recorded:
    """A stop's step log that records each step's name and cap, and runs it."""

    def __init__(self) -> None:
        self.caps: dict[str, float] = {}

    async def run(self, name: str, cap: float, work: Callable[[], Awaitable[object]]) -> None:
        self.caps[name] = cap
        await work()


async def nothing(*_: Any) -> None:
    return None


async def nothing_and(value: list[str]) -> list[str]:
    return value


def stop_caps(stop: Callable[[Recorded], Awaitable[None]]) -> dict[str, float]:
    steps = Recorded()
    asyncio.run(stop(steps))
    return steps.caps


CONFIG = config(
    shutdown={"kill_grace": 7.0, "subagent_drain": 9.0}, attach={"shutdown_timeout": 4.0}
)


def test_the_capped_steps_of_each_service_are_the_budgets(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = teardown_budget(CONFIG)
    found: dict[str, float] = {}
    http = HttpService(CONFIG, SimpleNamespace(stopping=False))  # type: ignore[arg-type]
    http.listener = SimpleNamespace(cleanup=nothing)  # type: ignore[assignment]
    found |= stop_caps(http.stop)
    found |= stop_caps(
        lambda steps: Pool.stop(SimpleNamespace(config=CONFIG, stop_descendants=nothing), steps)
    )
    monkeypatch.setattr(drain, "subagents_in_flight", lambda pool: nothing_and(["child"]))
    monkeypatch.setattr(drain, "subagent_drain", lambda pool, running, cap: nothing())
    reconciler = SimpleNamespace(config=CONFIG, pool=None, release=nothing)
    found |= stop_caps(lambda steps: Reconciler.stop(reconciler, steps))  # type: ignore[arg-type]
    host = SimpleNamespace(leave=lambda: None, ending=lambda: None)
    found |= stop_caps(lambda steps: Membership.stop(host, steps))  # type: ignore[arg-type]
    capped = ("http listener", "subagent drain", "descendants", "peer deregistration", "boot row")
    assert found == {name: budget.seconds(name) for name in capped}


def test_the_waits_outside_the_step_log_are_the_budgets() -> None:
    """The courier's settle and the task keeper's wait for starts in flight: their own
    constants (their services' modules), held to the budget's here."""
    assert deliveries.SETTLE_CAP == teardown.COURIER
    settle = inspect.signature(TaskKeeper.settle).parameters["timeout"].default
    assert settle == teardown.TASK_STARTS
    # TaskKeeper.stop waits with that default.
    waited: list[tuple[Any, ...]] = []

    async def recorded(*args: Any) -> None:
        waited.append(args)

    asyncio.run(TaskKeeper.stop(SimpleNamespace(settle=recorded), Recorded()))  # type: ignore[arg-type]
    assert waited == [()]
