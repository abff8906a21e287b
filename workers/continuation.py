"""A turn its worker continues instead of ending it: a cut answer, a model error that may pass.

The rules are `supervisor.core.continuation`'s; this module carries them out for one
session runner. The attempt is charged in the session row before the wait (write-ahead),
as recovery charges its own, so a worker killed while it waits leaves the turn to
recovery with the attempts that are left; the wait is the attempt schedule's
(`recovery.attempt_delays`) and goes through the runner's clock. An empty schedule
(`recovery.auto_continue = false`) continues nothing: the turn ends as the agent says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

from supervisor.contract.clock import Clock, sleep_unless
from supervisor.core import continuation, engine, recovery
from supervisor.core.engine import SessionView, Step
from supervisor.core.vocabulary import AssignReason, Cause
from supervisor.store import EventRecord, LeaseLost, Store
from workers import history, turns
from workers.models import Message

Run = Callable[[str, list[Message]], Awaitable[str]]
SUPERSEDED = "a newer user message drives the next turn"


class _Turn(Enum):
    """Where the turn stands when its worker looks again (the session row says)."""

    OURS = "ours"  # still the active turn, our lease, no user message queued
    QUEUED = "queued"  # a user message is queued: it drives the next turn
    GONE = "gone"  # no longer the active turn (ended by someone else): nothing to do


class Continuer:
    """Continues the turns of one session that would end cut or on a passing model error."""

    def __init__(
        self,
        session_id: str,
        *,
        store: Store,
        read: Callable[[], Awaitable[list[EventRecord]]],
        commit: turns.Commit,
        token: Callable[[], int],
        released: asyncio.Event,
        woken: asyncio.Event,
        delays: tuple[float, ...],
        clock: Clock,
        log: Any,
    ) -> None:
        self.session_id = session_id
        self._store = store
        self._read = read
        self._commit = commit
        self._token = token  # the lease token the turn writes with
        self._released = released
        self._woken = woken
        self.delays = tuple(delays)
        self._clock = clock
        self.log = log

    async def after(self, turn_id: str, ending: turns.Ending, started: float, run: Run) -> str:
        """End the turn as `ending` says, or continue it (the rules in the module docstring).

        `started`: when the run that came to `ending` began (the clock's wall time);
        `run` runs the agent on the turn again. Returns the turn's outcome.
        """
        cause = continuation.cause_of(ending.outcome, ending.transient) if self.delays else None
        if cause is not None:
            events = history.turn_events(await self._read(), turn_id)
            if not continuation.goes_on(cause, history.classify_tail(events)):
                cause = None
        if cause is None:
            return await turns.end_turn(ending, turn_id, self._commit)
        log = self.log.bind(turn=turn_id)
        stands = await self._stands(turn_id)
        if stands is not _Turn.OURS:
            return await self._stop(stands, ending, turn_id)
        count = await asyncio.to_thread(
            self._store.sessions.charge_attempt,
            self.session_id,
            turn_id,
            limit=len(self.delays),
            token=self._token(),
        )
        if count is None:  # the turn moved on, or the lease did (then this raises)
            return await self._stop(await self._stands(turn_id), ending, turn_id)
        attempt = count - 1
        if attempt > len(self.delays):
            log.warning(
                "turn {} ends {}: {}; its {} continuation attempts are spent",
                turn_id,
                ending.outcome,
                _why(cause, ending),
                len(self.delays),
            )
            return await turns.end_turn(ending, turn_id, self._commit, attempts=len(self.delays))
        due = recovery.next_attempt_at(attempt - 1, started, self.delays)
        assert due is not None  # attempt <= len(delays)
        log.info(
            "{}: continuing turn {}, attempt {} of {}, in {:.1f} s",
            _why(cause, ending),
            turn_id,
            attempt,
            len(self.delays),
            max(0.0, due - self._clock.time()),
        )
        stands = await self._wait(turn_id, due)
        if stands is not _Turn.OURS:
            return await self._stop(stands, ending, turn_id)
        error = ending.error if cause is Cause.MODEL_ERROR else None
        return await turns.resume_turn(
            turn_id, await self._read(), cause, self._commit, run, attempt=attempt, error=error
        )

    async def _stands(self, turn_id: str) -> _Turn:
        """Where the turn stands by the session row; LeaseLost if the lease moved on."""
        info = await asyncio.to_thread(self._store.sessions.get, self.session_id)
        token = self._token()
        step = engine.runner_step(SessionView.of(info), token, AssignReason.NEW)
        if step is Step.LEASE_LOST:
            raise LeaseLost(self.session_id, token, info.lease_token)
        if info.active_turn_id != turn_id:
            return _Turn.GONE
        if step is Step.SUPERSEDE:
            return _Turn.QUEUED
        return _Turn.OURS if step is Step.CONTINUE else _Turn.GONE

    async def _stop(self, stands: _Turn, ending: turns.Ending, turn_id: str) -> str:
        """The turn is not continued: a queued message ends it as it would have ended."""
        if stands is _Turn.QUEUED:
            self.log.bind(turn=turn_id).info("a queued message ends turn {}", turn_id)
            return await turns.end_turn(ending, turn_id, self._commit, reason=SUPERSEDED)
        return ending.outcome

    async def _wait(self, turn_id: str, due: float) -> _Turn:
        """Wait until `due` (wall time). A release ends the wait (TurnReleased: the next
        owner continues the turn); a wake (new input) looks at the session row again."""
        while (left := due - self._clock.time()) > 0 and not self._released.is_set():
            if await self._sleep_or_wake(left):
                self._woken.clear()  # the runner re-reads the row after the turn anyway
                stands = await self._stands(turn_id)
                if stands is not _Turn.OURS:
                    return stands
        if self._released.is_set():
            raise turns.TurnReleased
        return await self._stands(turn_id)

    async def _sleep_or_wake(self, seconds: float) -> bool:
        """Sleep `seconds` on the clock; True if woken or released before."""
        return await sleep_unless(self._clock, seconds, self._woken, self._released)


def _why(cause: Cause, ending: turns.Ending) -> str:
    if cause is Cause.MODEL_ERROR:
        return f"the model failed ({ending.error})"
    return "the model's answer was cut at its token limit"
