"""Running one turn: the context handed to the agent, and how a turn starts or resumes.

Every step commits its event before the next begins, so a crash loses at most the step
in flight. A release (rolling restart) stops the turn at the next event boundary, and an
in-flight model call is abandoned at once (it has no side effects); a tool call in flight
is let finish, so its result is recorded.

A model call's answer streams to the turn's live output as it comes (`workers.streaming`:
deltas to the supervisor, never to the database); the answer is committed whole once the
call ends, as one `model_response`. An operator's interrupt cuts a model call in flight
at once (its HTTP request closed) and commits what it streamed so far as a cut
`model_response` (finish reason "interrupted") before the turn ends
`interrupted_by_operator`. The compaction's own model calls do not stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from loguru import logger

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock, sleep_unless
from supervisor.contract.config import mask_urls
from supervisor.core.vocabulary import Cause, EventType, TurnOutcome
from supervisor.store import EventRecord, LeaseLost, StorageUnavailable
from workers import context, history
from workers.agent import OUTCOMES, Agent
from workers.budget import Budget, BudgetExhausted
from workers.cache import log_of
from workers.history import Tail
from workers.models import (
    SILENT,
    Message,
    Model,
    ModelError,
    ModelResponse,
    Stream,
    ToolCall,
    ToolSpec,
)
from workers.outage import NOTICE, OUTAGE_KEY, Health, Outage
from workers.restarting import OFF as RESTARTS_OFF
from workers.restarting import TOOL as RESTART_TOOL
from workers.restarting import Requester, RestartRefused
from workers.spawning import SPEC as SPAWN_SPEC
from workers.spawning import TOOL as SPAWN_TOOL
from workers.spawning import Spawner, SpawnRefused
from workers.streaming import LiveOutput
from workers.tasking import OFF as TASKS_OFF
from workers.tasking import TOOL as TASK_TOOL
from workers.tasking import Starter, TaskRefused
from workers.tools import Toolbox, ToolOutcome
from workers.tracing import RunTrace

Commit = Callable[[str, dict[str, Any], str | None], Awaitable[int]]

CONTINUATION_NOTES: dict[str, str] = {cause: cause.text for cause in Cause}


class TurnReleased(Exception):
    """The supervisor asked for the session back; stop at this event boundary."""


class TurnInterrupted(Exception):
    """The operator interrupted the turn: it ends `interrupted_by_operator`, at once."""


CUT = "interrupted"  # the finish_reason of an answer an interrupt cut


class TurnContext:
    """The `Turn` an agent is handed (see workers.agent)."""

    def __init__(
        self,
        session_id: str,
        turn_id: str,
        messages: list[Message],
        model: Model,
        toolbox: Toolbox,
        commit: Commit,
        released: asyncio.Event,
        spawner: Spawner | None = None,
        starter: Starter | None = None,
        requester: Requester | None = None,
        compactor: Callable[[TurnContext], context.Compactor] | None = None,
        outage: Outage | None = None,
        health: Health | None = None,
        budget: Budget | None = None,
        clock: Clock = SYSTEM,
        live: LiveOutput | None = None,
        interrupted: asyncio.Event | None = None,
        trace: RunTrace | None = None,
    ) -> None:
        self.session_id = session_id
        self.turn_id = turn_id
        self._messages = messages
        self._model = model
        self._toolbox = toolbox
        self._commit = commit
        self._released = released
        self._spawner = spawner if spawner is not None and spawner.limits.enabled else None
        self._spawns = 0  # `spawn_subagent` calls in this run of the turn
        self._starter = starter
        self._starts = 0  # `start_task` calls in this run of the turn
        self._requester = requester
        self._requests = 0  # `request_restart` calls in this run of the turn
        self._compactor = None if compactor is None else compactor(self)
        self._outage = outage
        self._health = health
        self.budget = budget
        self._clock = clock
        self._live = live  # where the answers stream to, as they come
        self._interrupted = interrupted if interrupted is not None else asyncio.Event()
        self.asking = False  # a model call of `call_model` is in flight
        self._trace = trace if trace is not None else RunTrace(None, session_id)

    @property
    def messages(self) -> list[Message]:
        """The conversation so far, this turn included."""
        return list(self._messages)

    @property
    def tools(self) -> list[ToolSpec]:
        """The tools on offer (`spawn_subagent`, `start_task` and `request_restart` among
        them while subagents and tasks may be started and agents may ask for restarts)."""
        specs = self._toolbox.specs()
        specs = [*specs, SPAWN_SPEC] if self._spawner is not None else specs
        specs = [*specs, self._starter.spec] if self._starter and self._starter.enabled else specs
        requester = self._requester
        return [*specs, requester.spec] if requester is not None and requester.enabled else specs

    def _boundary(self) -> None:
        if self._interrupted.is_set():
            raise TurnInterrupted
        if self._released.is_set():
            raise TurnReleased

    async def call_model(self) -> ModelResponse:
        """Ask the model; commits `model_response`. A release abandons the call.

        A prompt that would not fit the context window is compacted first; a server that
        says it did not fit gets one more call, after a compaction (`workers.context`).
        """
        self._boundary()
        tools, compactor = self.tools, self._compactor
        if compactor is not None:
            await compactor.fit(self._messages, tools)
        estimated = context.prompt_estimate(self._messages, tools)
        budget = self.budget
        if budget is not None:
            ratio = compactor.ratio if compactor is not None else 1.0
            try:
                budget.check(math.ceil(estimated * ratio) + budget.max_tokens)
            except BudgetExhausted as exc:
                await self.notice(f"turnkeeper: this turn ends: {exc}")
                raise
        try:
            try:
                response = await self._answer(tools)
            except ModelError as exc:
                if compactor is None or not exc.context_exceeded:
                    raise
                compactor.window.learn(exc.window)
                if not await compactor.fit(self._messages, tools, forced=True):
                    raise
                estimated = context.prompt_estimate(self._messages, tools)
                response = await self._answer(tools)
        except TurnInterrupted:
            await self._commit_cut(estimated)
            raise
        if compactor is not None:
            compactor.counted(estimated, response.usage)
        calls = [
            {"id": c.id, "name": c.name, "arguments": c.arguments} for c in response.tool_calls
        ]
        tokens = response.usage.get("completion_tokens")
        if tokens is None:
            tokens = context.estimate(response.text) + sum(
                context.estimate(json.dumps(call)) for call in calls
            )
        await self._commit(
            EventType.MODEL_RESPONSE,
            {
                "text": response.text,
                "tool_calls": calls,
                "finish_reason": response.finish_reason,
                "usage": response.usage,
                "prompt_estimate": estimated,
                "tokens": tokens,
            },
            self.turn_id,
        )
        prompt = response.usage.get("prompt_tokens") or estimated
        if budget is not None:
            budget.spent.add(prompt, tokens)
        if self._health is not None:
            self._health.spent(prompt, tokens)
        self._messages.append(
            Message("assistant", response.text, tool_calls=list(response.tool_calls), tokens=tokens)
        )
        return response

    async def _answer(self, tools: list[ToolSpec]) -> ModelResponse:
        """The model's answer to the conversation, streamed live as it comes."""
        live = self._live
        if live is None:
            return await self.ask(list(self._messages), tools)
        live.begin()
        self.asking = True
        try:
            return await self.ask(list(self._messages), tools, live)
        finally:
            self.asking = False
            live.finish()  # what waits goes now, before the answer is committed

    async def _commit_cut(self, estimated: int) -> None:
        """Commit what an interrupted model call streamed so far, as a cut answer: the
        text the user watched being written is kept in the log (nothing else is)."""
        text = self._live.streamed if self._live is not None else ""
        await self._commit(
            EventType.MODEL_RESPONSE,
            {
                "text": text,
                "tool_calls": [],
                "finish_reason": CUT,
                "usage": {},
                "prompt_estimate": estimated,
                "tokens": context.estimate(text),
            },
            self.turn_id,
        )

    async def ask(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        """One model call, nothing committed but an outage's notice, its answer told to
        `stream` as it comes; a release abandons it (TurnReleased), an interrupt cuts it
        (TurnInterrupted). A model server that is down is waited out (`workers.outage`)."""
        outage = self._outage
        while True:
            try:
                with self._trace.chat(messages) as answered:
                    response = await self._ask_once(messages, tools, stream)
                    answered(response)
            except ModelError as exc:
                if self._health is not None:
                    self._health.failed(exc.transient)
                if outage is None:
                    raise
                now = self._clock.time()
                delay = outage.wait(exc, now)
                if delay is None:
                    raise outage.spent(exc) from None
                if outage.since is None:
                    outage.since = now
                    payload = {"text": NOTICE, OUTAGE_KEY: now, "error": str(exc)}
                    await self._commit(EventType.NOTICE, payload, self.turn_id)
                if self._health is not None:
                    self._health.down(outage.since)
                await sleep_unless(self._clock, delay, self._released, self._interrupted)
                self._boundary()
                continue
            if outage is not None:
                outage.since = None
                outage.tries = 0
            if self._health is not None:
                self._health.up()
            return response

    async def _ask_once(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream
    ) -> ModelResponse:
        self._boundary()
        call = spawn(self._model.complete(messages, tools, stream), name="model-call")
        release = spawn(self._released.wait(), name="released")
        interrupt = spawn(self._interrupted.wait(), name="interrupted")
        try:
            await asyncio.wait({call, release, interrupt}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            call.cancel()  # the turn itself was cancelled: the call must not outlive it
            raise
        finally:
            release.cancel()
            interrupt.cancel()
        if not call.done():
            call.cancel()
            if not self._interrupted.is_set():
                raise TurnReleased
            # Its HTTP request is closed before the cut answer is committed: the server
            # stops generating, and nothing more streams after the cut.
            await asyncio.wait({call})
            raise TurnInterrupted
        return call.result()

    async def call_tool(self, call: ToolCall) -> ToolOutcome:
        """Commit `tool_call`, run it to the end, commit `tool_result`."""
        self._boundary()
        await self._commit(
            EventType.TOOL_CALL,
            {"call_id": call.id, "name": call.name, "arguments": call.arguments},
            self.turn_id,
        )
        with self._trace.tool(call) as result:
            outcome = await self._run_tool(call)
            result(outcome.content, outcome.is_error)
        tokens = context.estimate(outcome.content)
        await self._commit(
            EventType.TOOL_RESULT,
            {
                "call_id": call.id,
                "name": call.name,
                "content": outcome.content,
                "is_error": outcome.is_error,
                "tokens": tokens,
            },
            self.turn_id,
        )
        self._messages.append(Message("tool", outcome.content, tool_call_id=call.id, tokens=tokens))
        return outcome

    async def _run_tool(self, call: ToolCall) -> ToolOutcome:
        """Run the tool `call` names to its outcome; a tool's error is an outcome."""
        try:
            if call.name == SPAWN_TOOL and self._spawner is not None:
                return await self._spawner.call(call.arguments, self.turn_id, call.id)
            if call.name == TASK_TOOL and self._starter is not None:
                return await self._starter.call(call.arguments, self.turn_id, call.id)
            if call.name == RESTART_TOOL and self._requester is not None:
                return await self._requester.call(call.arguments, self.turn_id, call.id)
            return await self._toolbox.call(call.name, call.arguments)
        except (asyncio.CancelledError, TurnReleased, LeaseLost, StorageUnavailable):
            raise
        except BaseException as exc:  # a tool bug (SystemExit included) must not end the worker
            logger.bind(subsystem="worker").exception("tool {} raised", call.name)
            return ToolOutcome(f"the tool failed: {_describe(exc)}", is_error=True)

    async def notice(self, text: str) -> None:
        """Commit a `notice` for the user."""
        await self._commit(EventType.NOTICE, {"text": text}, self.turn_id)

    async def spawn_subagent(
        self, task: str, *, agent: str | None = None, title: str | None = None
    ) -> str:
        """Start a subagent for `task`; its session id (see `workers.spawning`).

        Its result arrives in this session as a `subagent_result`, which the session's
        next turn reads. SpawnRefused when the limits do not allow it, or subagents are
        off; `agent` must be one the operator allows (`agent.allowed`).
        """
        self._boundary()
        if self._spawner is None:
            raise SpawnRefused("subagents are off here (subagents.max_depth or max_children is 0)")
        # The n-th spawn of this task in a run of the turn: a continued turn whose agent
        # spawns the same again (it runs from the top) gets the child it started before.
        self._spawns += 1
        digest = hashlib.sha256(str(task).encode("utf-8", "replace")).hexdigest()[:16]
        key = f"turn.spawn_subagent:{self._spawns}:{digest}"
        return await self._spawner.spawn(task, self.turn_id, agent=agent, title=title, call_id=key)

    async def start_task(self, kind: str, args: dict[str, Any] | None = None) -> str:
        """Start a background task of the operator's `kind`; its id (see `workers.tasking`).
        Its outcome arrives as a `task_result`, which the session's next turn reads."""
        self._boundary()
        if self._starter is None:
            raise TaskRefused(TASKS_OFF)
        self._starts += 1
        return await self._starter.start_once(kind, args, self.turn_id, self._starts)

    async def request_restart(self, reason: str) -> str:
        """Ask for a restart of the daemon; the request's id, or the id of the one already
        in progress (see `workers.restarting`). The daemon restarts once this turn ends;
        the outcome arrives as a `restart_result`, which the session's next turn reads."""
        self._boundary()
        if self._requester is None:
            raise RestartRefused(RESTARTS_OFF)
        self._requests += 1
        return await self._requester.request_once(reason, self.turn_id, self._requests)


def _describe(exc: BaseException) -> str:
    """An exception as one short line: its type, and its message when it has one.

    It goes into an event: a password inside a URL in the message is masked.
    """
    text = mask_urls(" ".join(str(exc).split()))[:500]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def start_turn(
    commit: Commit,
    read: Callable[[], Awaitable[list[EventRecord]]],
    run: Callable[[str, list[Message]], Awaitable[str]],
) -> tuple[str, str]:
    """A new turn for pending input; returns (turn id, outcome).

    The history is read first; `turn_started` says how far (`read_to`), which clears the
    pending mark unless a user message came after that point: such a message was not
    seen by this turn and drives the next one, and the rebuilt history places it after
    this turn's answer, where it arrived as far as the model knows. `turn_started` also
    charges the turn's first attempt. A tool call an earlier turn left without a result
    (an operator interrupt, say) gets its synthetic error result first, so the model never
    sees a call without an answer. `read` gives the session's events: the worker's
    cached `SessionLog` has the messages built already, up to its last few events.
    """
    turn_id = uuid.uuid4().hex
    log = log_of(await read())
    await commit(EventType.TURN_STARTED, {"read_to": log.last_seq}, turn_id)
    repaired = [await _repair(missing, turn_id, commit) for missing in log.missing_results()]
    return turn_id, await run(turn_id, log.messages(repaired))


async def _repair(missing: history.MissingResult, turn_id: str, commit: Commit) -> EventRecord:
    payload = missing.payload()
    seq = await commit(EventType.TOOL_RESULT, payload, turn_id)
    return EventRecord(
        session_id="",
        seq=seq,
        type="tool_result",
        turn_id=turn_id,
        payload=payload,
        created_at=SYSTEM.time(),
        writer="worker",
    )


async def resume_turn(
    turn_id: str,
    events: list[EventRecord],
    cause: str,
    commit: Commit,
    run: Callable[[str, list[Message]], Awaitable[str]],
    *,
    attempt: int | None = None,
    error: str | None = None,
) -> str:
    """Go on with an interrupted turn, after repairing calls that lost their results.

    A turn whose final answer was already committed is only ended, so the user never
    gets the same reply twice. The note names the `cause`, and the continuation
    `attempt` it starts and the model's `error` when they are given.
    """
    log = log_of(events)
    this_turn = history.turn_events(log, turn_id)
    # Every unanswered call is repaired (chat APIs reject one anywhere in the history),
    # but only this turn's own decide whether the model must be called again.
    repaired = [await _repair(m, turn_id, commit) for m in log.missing_results()]
    own = history.missing_results(this_turn)
    tail = Tail.RUN if own else history.classify_tail(this_turn)
    if tail is Tail.ANSWERED:
        await commit(
            EventType.TURN_ENDED, {"outcome": TurnOutcome.COMPLETED, "recovered": True}, turn_id
        )
        return TurnOutcome.COMPLETED
    # A TRUNCATED tail is continued too: the note asks the model to go on from the cut.
    last_at = events[-1].created_at if events else SYSTEM.time()
    when = datetime.fromtimestamp(last_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    note = (
        f"[turnkeeper] This turn was interrupted because "
        f"{CONTINUATION_NOTES.get(cause, 'it stopped')}; the last event was recorded at "
        f"{when}. Everything above was recorded before that. Continue the turn from there."
    )
    payload: dict[str, Any] = {"cause": cause, "text": note, "last_event_at": last_at}
    if attempt is not None:
        payload["attempt"] = attempt
    if error is not None:
        payload["error"] = error
    await commit(EventType.CONTINUATION, payload, turn_id)
    # The repaired results go right after the calls they answer, as the log now has them.
    # Messages that came after the turn read its input are the next turn's to answer.
    messages = log.messages(repaired, turn_id)
    messages.append(Message("user", note, note=True))
    return await run(turn_id, messages)


async def supersede_turn(turn_id: str, events: list[EventRecord], commit: Commit) -> None:
    """End an interrupted turn because a queued user message drives the next one.

    Its calls without results are repaired first, under its own turn id.
    """
    for missing in history.missing_results(history.turn_events(events, turn_id)):
        await _repair(missing, turn_id, commit)
    await commit(
        EventType.TURN_ENDED,
        {"outcome": TurnOutcome.INTERRUPTED, "reason": "a newer user message drives the next turn"},
        turn_id,
    )


async def run_agent(agent: Agent, context: TurnContext, commit: Commit) -> str:
    """Run the agent to the end of the turn and commit `turn_ended` with its outcome.

    How errors end the turn: see `agent_ending`. The worker's runner does not end every
    turn here: one the model cut or failed with an error that may pass is continued
    (`workers.continuation`).
    """
    return await end_turn(await agent_ending(agent, context), context.turn_id, commit)


@dataclass(frozen=True)
class Ending:
    """How the agent's run of a turn came out: the `turn_ended` it calls for."""

    payload: dict[str, Any]  # the `turn_ended` payload

    @property
    def outcome(self) -> str:
        """The turn's outcome (`TurnOutcome`)."""
        return str(self.payload["outcome"])

    @property
    def transient(self) -> bool:
        """Failed on a model error that may pass (`ModelError.transient`)."""
        return bool(self.payload.get("transient", False))

    @property
    def error(self) -> str | None:
        """The error that failed the turn, if one did."""
        error = self.payload.get("error")
        return None if error is None else str(error)


async def agent_ending(agent: Agent, context: TurnContext) -> Ending:
    """Run the agent once to the end of the turn; how it ended (nothing is committed).

    A model error or an agent bug is a `failed` ending, with the error in its payload,
    whatever the agent raised: `SystemExit`, `KeyboardInterrupt`, `RecursionError` and
    `MemoryError` included, so that agent code never ends the worker. A release, a lost
    lease or a database that takes no writes ends nothing (the turn goes on later).
    """
    try:
        outcome = await agent.run_turn(context)
        if outcome not in OUTCOMES:
            raise ValueError(f"run_turn returned {outcome!r}, not one of {OUTCOMES}")
    except ModelError as exc:
        payload = {"outcome": TurnOutcome.FAILED, "error": str(exc), "transient": exc.transient}
        return _spent(Ending(payload), context)
    except BudgetExhausted as exc:
        return _spent(Ending({"outcome": TurnOutcome.BUDGET_EXHAUSTED, "error": str(exc)}), context)
    except TurnInterrupted:
        return _spent(Ending({"outcome": TurnOutcome.INTERRUPTED_BY_OPERATOR}), context)
    except (TurnReleased, asyncio.CancelledError, LeaseLost, StorageUnavailable):
        raise
    except BaseException as exc:
        logger.bind(subsystem="worker", session=context.session_id).opt(exception=exc).error(
            "agent failed: {}", _describe(exc)
        )
        error = f"agent error: {_describe(exc)}"
        return _spent(Ending({"outcome": TurnOutcome.FAILED, "error": error}), context)
    return _spent(Ending({"outcome": outcome}), context)


def _spent(ending: Ending, context: TurnContext) -> Ending:
    """`ending` with what the turn spent on the model (`tokens`), when it counts."""
    if context.budget is None:
        return ending
    return Ending({**ending.payload, "tokens": context.budget.payload()})


async def end_turn(ending: Ending, turn_id: str, commit: Commit, **extra: Any) -> str:
    """Commit the turn's `turn_ended` as `ending` says, with `extra` in its payload."""
    await commit(EventType.TURN_ENDED, {**ending.payload, **extra}, turn_id)
    return ending.outcome
