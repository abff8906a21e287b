"""The waits of a stop for turns in flight on this daemon's workers.

- The drain, the pool's part of the daemon's drain (`supervisor.runtime.root`): for a
  stop `shutdown.drain_budget` (or `turnkeeper stop --drain SECONDS`), intake already
  refusing; for a requested restart `restart.drain_budget` (or the request's own), intake
  still taking messages for the next boot. No session is assigned and every worker is
  told to start no turn (`drain`): the turns in flight may finish, up to the budget, and
  the drain ends as soon as every worker said that its own have (`undrained`). A turn an
  interrupted session waits to have continued is not in flight: the next boot goes on.
- The subagent drain (`shutdown.subagent_drain`), the subagents service's first stop
  step, after the HTTP listener has closed and before the workers are stopped: a
  subagent's turn in flight gets a few seconds to end, so that its result reaches its
  parent in this boot rather than after a restart. A child still running then is
  interrupted with the rest and resumed by recovery after the restart; the log names
  it. No wait at all when no subagent's turn is in flight.

The drain reads what the workers' heartbeats said (each beats at once when told to
drain, and as each of its turns ends); the subagent drain reads the database on a thread,
at most every POLL seconds (its cap is short). Both wait through `sleep` and `clock`,
seams a test moves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.core.vocabulary import SessionKind
from supervisor.pool.handle import WorkerHandle
from supervisor.store import SessionInfo, Store
from supervisor.teardown import SUBAGENT_CHECK


class Pool(Protocol):
    """What the drains read of the pool (`supervisor.pool.pool.Pool` is one)."""

    config: Config
    store: Store

    @property
    def assigned(self) -> Mapping[str, Any]: ...

    @property
    def workers(self) -> Mapping[str, WorkerHandle]: ...

    def hold_assignments(self) -> None: ...


POLL = 0.1  # the subagent drain's longest pause between two reads

Sleep = Callable[[float], Awaitable[object]]


def turns_in_flight(pool: Pool) -> list[SessionInfo]:
    """The sessions of this daemon's workers with a turn in flight (a database read)."""
    mine = set(pool.assigned)
    return [s for s in pool.store.sessions.with_work() if s.active_turn_id and s.id in mine]


def subagent_turns(pool: Pool) -> list[str]:
    """The ids of the subagent sessions among `turns_in_flight`."""
    return [s.id for s in turns_in_flight(pool) if s.kind == SessionKind.SUBAGENT]


def undrained(workers: Iterable[WorkerHandle]) -> list[WorkerHandle]:
    """The live workers whose turns in flight have not all ended: told to drain and not
    heard saying so yet, or heard with turns still running. A worker that is not ready
    runs none; one being replaced was killed, its turns with it."""
    return [
        w
        for w in workers
        if w.alive and w.ready and not w.replacing and (not w.draining or w.turns > 0)
    ]


async def drain(pool: Pool, budget: float, sleep: Sleep = SYSTEM.sleep) -> None:
    """Wait until no worker runs a turn (the workers were told to start none); the
    caller caps it at `budget`."""
    busy = undrained(pool.workers.values())
    turns = sum(w.turns for w in busy)
    log("shutdown").info(
        "draining: up to {:.0f} s for the turns in flight ({} when last heard) to end; none starts",
        budget,
        turns,
    )
    while undrained(pool.workers.values()):
        await sleep(POLL)


async def subagents_in_flight(pool: Pool) -> list[str]:
    """The subagent sessions with a turn in flight here; none if the database does not
    answer within SUBAGENT_CHECK (the stop goes on without the wait)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(subagent_turns, pool), SUBAGENT_CHECK)
    except Exception as exc:  # a database gone or too slow: no drain, the stop goes on
        log("shutdown").error("subagent drain skipped: reading the turns failed: {!r}", exc)
        return []


async def subagent_drain(
    pool: Pool,
    running: list[str],
    cap: float,
    *,
    clock: Callable[[], float] = SYSTEM.monotonic,
    sleep: Sleep = SYSTEM.sleep,
) -> list[str]:
    """Wait, up to `cap` seconds, while a subagent's turn is in flight here (`running` at
    first); returns, and logs, the ids still running at the end."""
    deadline = clock() + cap
    # Only turns in flight may end: no session is assigned meanwhile (a parent woken by a
    # result, a child's pending task), to be cut a moment later.
    pool.hold_assignments()
    log("shutdown").info(
        "subagent drain: waiting up to {:g} s for {} subagent turns in flight", cap, len(running)
    )
    pause = min(pool.config.pool.heartbeat_interval, POLL)
    while running and (left := deadline - clock()) > 0:
        await sleep(min(pause, left))
        running = await asyncio.to_thread(subagent_turns, pool)
    if running:
        log("shutdown").warning(
            "subagent drain: {} subagents still running, interrupted with the rest and "
            "resumed after the restart: {}",
            len(running),
            ", ".join(running),
        )
    return running
