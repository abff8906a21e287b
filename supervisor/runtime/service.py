"""The service protocol: one long-running part of the daemon (celery's bootsteps, with
asyncio 3.11).

A service is built by the composition root (`supervisor.composition`) with the services
it names in `needs` passed to its constructor, nothing assigned afterwards; `after` names
services it must start after and stop before without using them (the task keeper starts
runners the pool's stop must find). Then:

- `start()`: what must be done before the daemon serves (bind a socket, start the first
  worker, read the breaker). A start that raises undoes the services started before it,
  in reverse.
- `run()`: its loops under one `asyncio.TaskGroup` (`loops()` names them), from the end
  of every start until it is cancelled at its stop. A loop that ends by itself, or raises,
  ends the daemon: exit non-zero, to be restarted by the service manager.
- `reconfigure(config)`: a reload put `config` in force; `takes` names the sections the
  service takes live (the others it reads once, at its start).
- `drain(deadline)`: the stop began; take no new work and let the work under way end,
  until `deadline` (the event loop's time). A service with `drains` set stays up through
  the daemon's drain: the root drains before it stops the first of them.
- `stop(steps)`: after its run is cancelled; each part of it is a named step with a cap
  (`steps.run(name, cap, work)`), timed, logged and survived whatever it raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, ClassVar, Protocol

from supervisor.contract.background import run_loops
from supervisor.contract.config import Config


class Steps(Protocol):
    """The stop's steps: each capped, timed and logged; the stop goes on after a failure."""

    async def run(self, name: str, cap: float, work: Callable[[], Awaitable[object]]) -> None: ...


class Service:
    """A part of the daemon with a lifecycle; see the module's docstring."""

    name: ClassVar[str]
    needs: ClassVar[tuple[str, ...]] = ()  # the services passed to the constructor
    after: ClassVar[tuple[str, ...]] = ()  # started after (stopped before), not used
    takes: ClassVar[tuple[str, ...]] = ()  # configuration sections it takes on a reload
    drains: ClassVar[bool] = False  # stays up through the drain

    async def start(self) -> None:
        return None

    def loops(self) -> Mapping[str, Coroutine[Any, Any, None]]:
        """Its long-running loops, by name; none by default."""
        return {}

    async def run(self) -> None:
        """Its loops until cancelled (a service without loops waits to be cancelled)."""
        loops = self.loops()
        if loops:
            await run_loops(loops)
        else:
            await asyncio.get_running_loop().create_future()

    def reconfigure(self, config: Config) -> None:
        return None

    async def drain(self, deadline: float) -> None:
        return None

    async def stop(self, steps: Steps) -> None:
        return None
