"""One session inside a worker: run its turns while the worker owns it.

The runner re-reads the session row whenever it is kicked (assign, wake, the end of a
turn) and does what the row says: continue an interrupted turn, start a turn for pending
input, or wait. It writes with the lease token of its latest assignment; a token that is
no longer current makes every write fail with LeaseLost, and the runner gives up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from loguru import logger

from supervisor import autonomy
from supervisor.control import CONTINUATION_CAUSE
from supervisor.store import EventRecord, Lease, LeaseLost, Store
from workers import turns
from workers.agent import Agent
from workers.models import Message, Model
from workers.tools import Toolbox

Notify = Callable[..., Awaitable[None]]


class SessionRunner:
    """Runs the turns of one session, one at a time."""

    def __init__(
        self,
        session_id: str,
        token: int,
        reason: str,
        *,
        cause: str | None = None,
        store: Store,
        make_agent: Callable[[str], Agent],
        model: Model,
        toolbox: Toolbox,
        notify: Notify,
        observe: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.session_id = session_id
        self.token = token
        self.reason = reason
        self.cause = cause  # what recovery found stopped the turn, for the note
        self._turn_token = token
        self._store = store
        self._make_agent = make_agent
        self._agent: Agent | None = None
        self._model = model
        self._toolbox = toolbox
        self._notify = notify
        self._observe = observe  # append latency, for the metrics
        self._kicked = asyncio.Event()
        self.released = asyncio.Event()
        self.in_turn = False
        self.task: asyncio.Task[None] | None = None
        self.log = logger.bind(subsystem="worker", session=session_id)

    def start(self) -> None:
        """Start the runner's task and look for work at once."""
        self.task = asyncio.create_task(self._loop(), name=f"session-{self.session_id}")
        self.kick()

    def reassign(self, token: int, reason: str, cause: str | None = None) -> None:
        """A newer assignment: write with its token from now on."""
        self.token, self.reason, self.cause = token, reason, cause
        self.kick()

    def kick(self) -> None:
        """Re-read the session: there may be work."""
        self._kicked.set()

    def interrupt(self) -> None:
        """The operator ended the turn (in the database, lease revoked): stop it now."""
        if self.task is not None:
            self.task.cancel()

    def release(self) -> None:
        """Stop at the next event boundary and give the session back."""
        self.released.set()
        self._kicked.set()

    async def _loop(self) -> None:
        try:
            while not self.released.is_set():
                await self._kicked.wait()
                self._kicked.clear()
                if self.released.is_set():
                    break
                await self._run_available()
        except turns.TurnReleased:
            pass
        except asyncio.CancelledError:
            self.log.info("turn cancelled")
            raise
        except LeaseLost as exc:
            self.log.warning("fenced out: {}", exc)
            await self._notify("lease_lost", session=self.session_id)
            return
        except Exception:
            self.log.exception("session runner failed")
            return
        if self.released.is_set():
            await asyncio.to_thread(self._release_lease)
            await self._notify("released", session=self.session_id)

    def _release_lease(self) -> None:
        self._store.leases.release(Lease(self.session_id, "", self.token, 0.0))

    async def _run_available(self) -> None:
        while not self.released.is_set():
            info = await asyncio.to_thread(self._store.sessions.get, self.session_id)
            if info.lease_token != self.token:
                raise LeaseLost(self.session_id, self.token, info.lease_token)
            if info.status != "open" or not (info.active_turn_id or info.pending):
                return
            if self._agent is None:
                self._agent = self._make_agent(info.agent)
            # The turn writes with the token it started under: a newer assignment arriving
            # mid-turn fences this run out (LeaseLost) instead of lending it the new token.
            self._turn_token = self.token
            self.in_turn = True
            try:
                if info.active_turn_id and info.pending and self.reason != "handoff":
                    # A queued user message drives the next turn itself, with no note.
                    self.log.info("a queued message supersedes turn {}", info.active_turn_id)
                    await turns.supersede_turn(
                        info.active_turn_id, await self._read(), self._commit
                    )
                    turn_id, outcome = await turns.start_turn(self._commit, self._read, self._run)
                elif info.active_turn_id:
                    cause = self.cause or CONTINUATION_CAUSE.get(self.reason, "interrupted")
                    self.log.info("continuing turn {} ({})", info.active_turn_id, cause)
                    turn_id = info.active_turn_id
                    outcome = await turns.resume_turn(
                        turn_id, await self._read(), cause, self._commit, self._run
                    )
                else:
                    turn_id, outcome = await turns.start_turn(self._commit, self._read, self._run)
            finally:
                self.in_turn = False
            # Whatever comes next is a fresh turn or another continuation of ours.
            self.reason, self.cause = "new", None
            if info.kind == "autonomous":
                await self._checkpoint()
            await self._notify(
                "turn_done", session=self.session_id, turn_id=turn_id, outcome=outcome
            )

    async def _checkpoint(self) -> None:
        """An autonomous run: record its counters; while no budget is spent, go on."""
        events = await self._read()
        progress = autonomy.progress(events, time.time())
        found = autonomy.run_of(events)
        if progress is None or found is None:
            return
        await self._commit("checkpoint", progress, None)
        if progress["stop_reason"] is not None:
            reason, done = progress["stop_reason"], progress["turns"]
            self.log.info("autonomous run stopped ({}) after {} turns", reason, done)
            return
        await self._commit("user_message", {"text": found[0].prompt, "autonomous": True}, None)

    async def _read(self) -> list[EventRecord]:
        return await asyncio.to_thread(self._store.events.read, self.session_id, 0, 1_000_000)

    async def _run(self, turn_id: str, messages: list[Message]) -> str:
        context = turns.TurnContext(
            self.session_id,
            turn_id,
            messages,
            self._model,
            self._toolbox,
            self._commit,
            self.released,
        )
        assert self._agent is not None
        return await turns.run_agent(self._agent, context, self._commit)

    async def _commit(self, type: str, payload: dict[str, Any], turn_id: str | None) -> int:
        now = time.time()
        started = time.perf_counter()
        seq = await self._store.events.append_async(
            self.session_id, type, payload, token=self._turn_token, turn_id=turn_id, created_at=now
        )
        self._observe(time.perf_counter() - started)
        await self._notify(
            "committed",
            session=self.session_id,
            event={
                "seq": seq,
                "type": type,
                "turn_id": turn_id,
                "payload": payload,
                "created_at": now,
            },
        )
        return seq
