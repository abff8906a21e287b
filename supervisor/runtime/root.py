"""The lifecycle of a tree of services (`supervisor.runtime.service`): start in dependency
order, run, reconfigure, drain and stop in reverse order.

- `Root(services)` orders them so that each comes after the services it `needs` (the
  order they are given in, where `needs` leave a choice); a need that names no service,
  or a cycle, is a `ValueError` at once.
- `start()` starts each in order; one that raises makes the root stop those started
  before it, in reverse, and raises. `run()` then runs every service's loops, each
  service's as one task; `ended` is told when one ends by itself or raises.
- `stop(steps, drain)` stops in reverse order: each service's run is cancelled and
  awaited, then its `stop`. Before the first service that `drains`, the drain: `drain`
  (the daemon's step, with its budget) runs every service's `drain(deadline)` at once.
- `reconfigure(config)` hands each service the configuration a reload put in force.
- `describe()` is the tree as the code declares it, for the architecture page and its
  test.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from supervisor.contract.background import spawn
from supervisor.contract.config import Config
from supervisor.runtime.service import Service, Steps


class Root:
    """Starts, runs, reconfigures and stops a tree of services."""

    def __init__(self, services: Iterable[Service]) -> None:
        self.services = order(services)
        self.started: list[Service] = []
        self.runs: dict[str, asyncio.Task[None]] = {}
        self.drained = False

    def __getitem__(self, name: str) -> Service:
        for service in self.services:
            if service.name == name:
                return service
        raise KeyError(name)

    async def start(self, steps: Steps) -> None:
        for service in self.services:
            try:
                await service.start()
            except BaseException:
                await self.stop(steps)
                raise
            self.started.append(service)

    def run(self, ended: Callable[[str, asyncio.Task[None]], None]) -> None:
        """Every started service's loops, each service's as a task; `ended(name, task)` if
        one ends other than by its stop."""
        for service in self.started:
            if service.name not in self.runs:
                self.runs[service.name] = spawn(
                    service.run(),
                    name=service.name,
                    ended=functools.partial(self._ended, service.name, ended=ended),
                )

    def _ended(
        self,
        name: str,
        task: asyncio.Task[None],
        *,
        ended: Callable[[str, asyncio.Task[None]], None],
    ) -> None:
        if self.runs.get(name) is task:  # not cancelled by its stop
            ended(name, task)

    def reconfigure(self, config: Config) -> None:
        """Each service takes `config`; the first that raises stops the reconfiguration
        (the caller puts the configuration before it back the same way)."""
        for service in self.services:
            service.reconfigure(config)

    async def drain(self, run: DrainRunner) -> None:
        """The drain, once: `run` (the daemon's drain step: its budget, its cap, its cut)
        is handed the function that drains every started service at once until a
        deadline."""
        if self.drained:
            return
        self.drained = True

        async def drains(deadline: float) -> None:
            await asyncio.gather(*(s.drain(deadline) for s in reversed(self.started)))

        await run(drains)

    async def stop(self, steps: Steps, drain: DrainRunner | None = None) -> None:
        """Stop every started service in reverse order, the drain (if any) before the
        first that `drains` (see the module's docstring)."""
        while self.started:
            service = self.started[-1]
            if service.drains and drain is not None:
                await self.drain(drain)
            run = self.runs.pop(service.name, None)
            if run is not None:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            await service.stop(steps)
            self.started.pop()

    def describe(self) -> list[dict[str, Any]]:
        """The services in start order: name, needs, live sections, whether it drains and
        its loops (names only; the coroutines are closed unrun)."""
        tree = []
        for service in self.services:
            loops = service.loops()
            for work in loops.values():
                work.close()
            tree.append(
                {
                    "name": service.name,
                    "class": f"{type(service).__module__}.{type(service).__qualname__}",
                    "needs": list(service.needs),
                    "after": list(service.after),
                    "takes": list(service.takes),
                    "drains": service.drains,
                    "loops": sorted(loops),
                }
            )
        return tree


def order(services: Iterable[Service]) -> list[Service]:
    """`services` so that each comes after those it needs; stable where they leave a
    choice. A need that is not among them, or a cycle, is a ValueError."""
    given = list(services)
    by_name = {s.name: s for s in given}
    if len(by_name) != len(given):
        raise ValueError("two services share a name")
    for s in given:
        missing = [n for n in (*s.needs, *s.after) if n not in by_name]
        if missing:
            raise ValueError(f"service {s.name} needs {', '.join(missing)}, which is not built")
    placed: list[Service] = []
    done: set[str] = set()
    while len(placed) < len(given):
        ready = [
            s for s in given if s.name not in done and all(n in done for n in (*s.needs, *s.after))
        ]
        if not ready:
            left = sorted(s.name for s in given if s.name not in done)
            raise ValueError(f"the services {', '.join(left)} need each other (a cycle)")
        placed.append(ready[0])
        done.add(ready[0].name)
    return placed


Drains = Callable[[float], Awaitable[None]]
DrainRunner = Callable[[Drains], Awaitable[None]]
