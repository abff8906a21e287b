"""Concurrent work in one event loop: the one place an asyncio task is created.

Every process of turnkeeper (the supervisor, a worker) starts concurrent work through
these helpers, never with a bare `asyncio.create_task`:

- `run_loops`: the loops of a service, under one `asyncio.TaskGroup`. One that raises
  cancels its siblings and the error reaches whoever runs the service; cancelling the
  caller cancels them all and waits for them.
- `Background`: work a service starts and does not wait for at once (a handoff, a
  child's exit status read in a thread). It is held, its failure is logged, and
  `close()` cancels and awaits what is left, so nothing outlives its owner.
- `spawn`: one task the caller owns and awaits or cancels itself (a service's run, a
  reload in flight). The task is referenced until it ends.
- `first_of`: wait for the first of several awaitables; the others are cancelled.

A test that must find none elsewhere: `tests/project/test_structure.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from supervisor.contract.logs import log

T = TypeVar("T")

_live: set[asyncio.Task[Any]] = set()  # spawned and not yet ended: the loop holds tasks weakly


def spawn(
    work: Coroutine[Any, Any, T],
    *,
    name: str | None = None,
    ended: Callable[[asyncio.Task[T]], None] | None = None,
) -> asyncio.Task[T]:
    """Run `work` concurrently; the caller owns the task (awaits or cancels it). `ended`
    is called once it is done, however it ended."""
    task = asyncio.get_running_loop().create_task(work, name=name)
    _live.add(task)
    task.add_done_callback(_live.discard)
    if ended is not None:
        task.add_done_callback(ended)
    return task


class LoopDied(Exception):
    """A loop of a service ended by itself or raised: the service cannot do its job."""

    def __init__(self, loop: str, cause: BaseException | None) -> None:
        super().__init__(f"task {loop} " + (f"died: {cause!r}" if cause else "ended"))
        self.loop, self.cause = loop, cause


async def run_loops(loops: Mapping[str, Coroutine[Any, Any, Any]]) -> None:
    """Run `loops` (by name) until the caller is cancelled, under one TaskGroup. A loop
    runs until cancelled: one that ends or raises raises `LoopDied` here (naming it),
    once its siblings are cancelled; in every case none is left running."""
    pending = dict(loops)
    try:
        async with asyncio.TaskGroup() as group:
            while pending:
                name, work = pending.popitem()
                group.create_task(_named(name, work), name=name)
    except BaseExceptionGroup as group_error:
        died = [e for e in group_error.exceptions if isinstance(e, LoopDied)]
        if died:
            raise died[0] from None
        raise
    finally:
        for work in pending.values():  # not started: close them, no "never awaited"
            work.close()


async def _named(name: str, work: Coroutine[Any, Any, Any]) -> None:
    try:
        await work
    except Exception as exc:
        raise LoopDied(name, exc) from exc
    raise LoopDied(name, None)


async def first_of(*works: Awaitable[Any]) -> set[asyncio.Future[Any]]:
    """Wait until one of `works` is done; the others are cancelled. Returns the done ones
    (compare with the futures you passed: pass futures or tasks to tell them apart)."""
    futures: list[asyncio.Future[Any]] = [asyncio.ensure_future(w) for w in works]
    try:
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
        return set(done)
    finally:
        for future in futures:
            if not future.done():
                future.cancel()


class Background:
    """Work its owner starts and does not await at once; see the module's docstring."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = spawn(work, name=name or f"{self.owner}-background", ended=self._ended)
        self._tasks.add(task)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log(self.owner).warning("background work failed: {!r}", exc)

    def tasks(self) -> Iterable[asyncio.Task[Any]]:
        return list(self._tasks)

    async def settle(self) -> None:
        """Wait for the work under way to end by itself."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel the work under way and wait until it has ended."""
        running = list(self._tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
