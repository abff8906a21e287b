"""A turn its own worker continues instead of ending it (a cut answer, a model error that
may pass): the rules without I/O, the capped charge on a real database, and the session
runner on a real SQLite store with a fake clock, so the schedule is checked without a
single real wait."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from supervisor.contract.config import RecoveryConfig
from supervisor.core import recovery
from supervisor.core.continuation import cause_of, charged_after_note, goes_on
from supervisor.core.recovery import Action, Trigger
from supervisor.core.tail import Resume, TailClass
from supervisor.core.vocabulary import Cause
from supervisor.store import EventRecord, Store
from tests.clock import FakeClock
from tests.conftest import BACKENDS
from tests.daemon import outcome_of
from workers.agents.tool_loop import ToolLoopAgent
from workers.models import SILENT, Message, ModelError, ModelResponse, Stream, ToolSpec
from workers.runner import SessionRunner
from workers.tools import BuiltinTools

NOW = 1_800_000_000.0
DELAYS = (0.0, 5.0, 30.0)

# --- the rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "transient", "cause"),
    [
        ("truncated", False, "max_tokens"),
        ("failed", True, "model_error"),
        ("failed", False, None),  # an error that will not pass, or an agent bug
        ("completed", False, None),
        ("interrupted", False, None),
    ],
)
def test_what_a_turn_is_continued_for(outcome: str, transient: bool, cause: str | None) -> None:
    assert cause_of(outcome, transient) == cause


@pytest.mark.parametrize(
    ("cause", "tail", "on"),
    [
        ("max_tokens", Resume.TRUNCATED, True),
        ("max_tokens", Resume.ANSWERED, False),  # the agent said cut; the log says answered
        ("max_tokens", Resume.RUN, False),
        ("model_error", Resume.RUN, True),
        ("model_error", Resume.TRUNCATED, True),  # failed while going on from a cut
        ("model_error", Resume.ANSWERED, False),  # its answer is in: nothing to continue
    ],
)
def test_the_log_must_leave_something_to_continue(cause: str, tail: Resume, on: bool) -> None:
    assert goes_on(Cause(cause), tail) is on


def event(
    seq: int, type: str, payload: dict[str, Any] | None = None, at: float = NOW
) -> EventRecord:
    turn = None if type == "user_message" else "t1"
    return EventRecord("s1", seq, type, turn, payload or {}, at, "worker")


def note(seq: int, attempt: int | None, at: float = NOW) -> EventRecord:
    payload: dict[str, Any] = {"cause": "model_error", "text": "[turnkeeper] ..."}
    if attempt is not None:
        payload["attempt"] = attempt
    return event(seq, "continuation", payload, at)


@pytest.mark.parametrize(
    ("notes", "attempts", "after"),
    [
        ([], 1, False),
        ([note(3, 1)], 1, False),  # the note's own attempt: it died on its note
        ([note(3, 1)], 2, True),  # its worker charged the next one after it
        ([note(3, 1), note(4, 2)], 2, False),
        ([note(3, None)], 2, False),  # a note from before notes named their attempt
    ],
)
def test_an_attempt_charged_after_the_last_note(
    notes: list[EventRecord], attempts: int, after: bool
) -> None:
    assert charged_after_note([event(2, "turn_started"), *notes], attempts) is after


def row(attempt_count: int) -> SimpleNamespace:
    return SimpleNamespace(
        active_turn_id="t1",
        attempt_turn_id="t1",
        attempt_count=attempt_count,
        lease_expires_at=NOW - 1,
        owner="host/boot1234/w0.1",
        status="open",
        pending=False,
        updated_at=NOW,
    )


def judged(attempt_count: int, *tail: EventRecord) -> recovery.Decision:
    events = [event(1, "user_message", {"text": "x"}), event(2, "turn_started"), *tail]
    facts = recovery.interruption(
        row(attempt_count),
        events,
        Trigger.WORKER_DEATH,
        NOW + 100,
        host_prefix="host/",
        last_attempt_at=None,
        died=True,
    )
    return recovery.decide(facts, Trigger.WORKER_DEATH, NOW + 100, False, RecoveryConfig())


def test_a_worker_killed_waiting_for_its_attempt_leaves_a_turn_recovery_continues() -> None:
    # Attempt 1 wrote its note; its model call failed; attempt 2 was charged; the worker
    # died in the wait. The note is not a note to refuse a note on: attempt 3 goes on.
    decision = judged(3, note(3, 1, at=NOW))
    assert (decision.action, decision.attempt, decision.cause) == (
        Action.CONTINUE,
        3,
        "worker_crash",
    )


def test_a_continuation_that_died_on_its_note_still_asks_to_resend() -> None:
    decision = judged(2, note(3, 1))
    assert (decision.action, decision.quarantine) == (Action.NOTICE_RESEND, False)
    assert "last_is_continuation_note" in decision.reason


def test_a_turn_whose_attempts_its_worker_spent_is_never_continued_past_the_last() -> None:
    decision = judged(4, note(3, 1), note(4, 2), note(5, 3))
    assert (decision.action, decision.quarantine) == (Action.NOTICE_RESEND, True)


def test_a_cut_answer_after_a_note_is_still_a_cut_answer() -> None:
    cut = event(4, "model_response", {"text": "echo", "finish_reason": "length"})
    facts = recovery.interruption(
        row(3),
        [event(1, "user_message"), event(2, "turn_started"), note(3, 1), cut],
        Trigger.WORKER_DEATH,
        NOW,
        host_prefix="host/",
        last_attempt_at=None,
        died=True,
    )
    assert (facts.tail, facts.cause, facts.attempts) == (
        TailClass.CUT_BY_MAX_TOKENS,
        "max_tokens",
        2,
    )


# --- the capped charge, on a real database -------------------------------------------------


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_capped_charge_never_counts_past_the_last_attempt(store: Store) -> None:
    sid = store.sessions.create("admin").id
    lease = store.leases.acquire(sid, "w0.1", 30)
    assert lease is not None
    store.events.append(sid, "user_message", {"text": "x"}, writer="cli")
    store.events.append(sid, "turn_started", {"read_to": 1}, turn_id="t1", token=lease.token)
    counts = [
        store.sessions.charge_attempt(sid, "t1", limit=3, token=lease.token) for _ in range(5)
    ]
    assert counts == [2, 3, 4, 5, 5]  # 5: spent, and not written
    assert store.sessions.get(sid).attempt_count == 4
    assert store.sessions.charge_attempt(sid, "t1", limit=3, token=lease.token + 1) is None
    assert store.sessions.charge_attempt(sid, "t2", limit=3) is None


# --- the session runner, on a real store, with a fake clock ---------------------------------


def answer(text: str, finish: str = "stop") -> ModelResponse:
    return ModelResponse(text, [], finish, {})  # type: ignore[arg-type]


BUSY = ModelError("model server http://m answered 503: busy", transient=True)


class Scripted:
    """A model that answers from a script, one step a call (the last one repeats)."""

    def __init__(self, *steps: ModelResponse | ModelError) -> None:
        self.steps = steps
        self.calls = 0

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        step = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        if isinstance(step, ModelError):
            raise step
        return step

    async def aclose(self) -> None:
        pass


async def until(predicate: Callable[[], Any], what: str) -> Any:
    """Let the runner work (its database calls run in threads) until `predicate` holds."""
    for _ in range(6000):  # a bound on a broken runner, not on a slow machine: 60 s
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.01)
    pytest.fail(f"the runner never got to: {what}")


class Harness:
    """One session with a user message, run by a real SessionRunner on `store`."""

    def __init__(self, store: Store, model: Scripted, text: str = "hello") -> None:
        self.store = store
        self.model = model
        self.clock = FakeClock(wall=NOW)
        self.sid = store.sessions.create("admin").id
        lease = store.leases.acquire(self.sid, "host/boot/w0.1", 300)
        assert lease is not None
        store.events.append(self.sid, "user_message", {"text": text}, writer="cli")

        async def notify(*args: Any, **fields: Any) -> None:
            pass

        self.runner = SessionRunner(
            self.sid,
            lease.token,
            "new",
            store=store,
            make_agent=lambda name: ToolLoopAgent(),
            model=model,
            toolbox=BuiltinTools(),
            notify=notify,
            attempt_delays=DELAYS,
            clock=self.clock,
        )

    def events(self, type: str | None = None) -> list[EventRecord]:
        found = self.store.events.read(self.sid, limit=1000)
        return [e for e in found if type is None or e.type == type]

    def ended(self) -> EventRecord | None:
        return next(iter(self.events("turn_ended")), None)

    async def waiting(self) -> None:
        """Until the runner sleeps on the clock (the wait for an attempt)."""
        await until(lambda: self.clock.sleepers == 1, "the wait for the next attempt")

    async def stop(self) -> None:
        assert self.runner.task is not None
        self.runner.task.cancel()
        await asyncio.gather(self.runner.task, return_exceptions=True)


def test_a_passing_model_error_is_continued_on_the_schedule(store: Store) -> None:
    h = Harness(store, Scripted(BUSY, BUSY, answer("at last")))

    async def go() -> None:
        h.runner.start()
        # Attempt 1 is due at once: its note comes with no wait on the clock.
        await until(lambda: len(h.events("continuation")) == 1, "attempt 1")
        await h.waiting()  # attempt 2 is due 5 s after attempt 1 started
        assert store.sessions.get(h.sid).attempt_count == 3  # charged before the wait
        await h.clock.advance(4.9)
        await h.waiting()
        assert len(h.events("continuation")) == 1
        await h.clock.advance(0.1)
        await until(h.ended, "the end of the turn")
        await h.stop()

    asyncio.run(go())
    notes = [e.payload for e in h.events("continuation")]
    assert [(n["cause"], n["attempt"], n["error"]) for n in notes] == [
        ("model_error", 1, str(BUSY)),
        ("model_error", 2, str(BUSY)),
    ]
    assert "may pass" in notes[0]["text"]
    ended = h.ended()
    assert ended is not None and outcome_of(ended.payload) == {"outcome": "completed"}
    assert [e.payload["text"] for e in h.events("model_response")] == ["at last"]
    assert h.model.calls == 3
    assert store.sessions.get(h.sid).attempt_count == 0  # cleared by turn_ended


def test_a_model_that_keeps_failing_ends_the_turn_after_the_last_attempt(store: Store) -> None:
    h = Harness(store, Scripted(BUSY))

    async def go() -> None:
        h.runner.start()
        await h.waiting()
        await h.clock.advance(5.0)
        await h.waiting()
        await h.clock.advance(30.0)
        await until(h.ended, "the end of the turn")
        await h.stop()

    asyncio.run(go())
    assert [e.payload["attempt"] for e in h.events("continuation")] == [1, 2, 3]
    ended = h.ended()
    assert ended is not None
    assert outcome_of(ended.payload) == {
        "outcome": "failed",
        "error": str(BUSY),
        "transient": True,
        "attempts": 3,
    }
    assert h.model.calls == 4  # the turn's own run and its three attempts


def test_an_error_that_will_not_pass_fails_the_turn_at_once(store: Store) -> None:
    refused = ModelError("model server http://m answered 400: bad request")
    h = Harness(store, Scripted(refused, answer("never")))

    async def go() -> None:
        h.runner.start()
        await until(h.ended, "the end of the turn")
        await h.stop()

    asyncio.run(go())
    ended = h.ended()
    assert ended is not None
    assert outcome_of(ended.payload) == {
        "outcome": "failed",
        "error": str(refused),
        "transient": False,
    }
    assert h.events("continuation") == [] and h.model.calls == 1


def test_a_cut_answer_is_continued_and_the_turn_completes(store: Store) -> None:
    h = Harness(store, Scripted(answer("echo: a b", "length"), answer("c d")))

    async def go() -> None:
        h.runner.start()
        await until(h.ended, "the end of the turn")
        await h.stop()

    asyncio.run(go())
    [cut_note] = [e.payload for e in h.events("continuation")]
    assert (cut_note["cause"], cut_note["attempt"]) == ("max_tokens", 1)
    assert "error" not in cut_note and "token limit" in cut_note["text"]
    types = [e.type for e in h.events()]
    assert types == [
        "user_message",
        "turn_started",
        "model_response",
        "continuation",
        "model_response",
        "turn_ended",
    ]
    ended = h.ended()
    assert ended is not None and outcome_of(ended.payload) == {"outcome": "completed"}


def test_a_message_sent_during_the_wait_ends_the_turn_and_drives_the_next(store: Store) -> None:
    h = Harness(store, Scripted(BUSY, BUSY, answer("next")))

    async def go() -> None:
        h.runner.start()
        await h.waiting()
        store.events.append(h.sid, "user_message", {"text": "are you there?"}, writer="cli")
        h.runner.wake()  # what the supervisor's wake does
        await until(lambda: len(h.events("turn_ended")) == 2, "the next turn to end")
        await h.stop()

    asyncio.run(go())
    first, second = h.events("turn_ended")
    assert outcome_of(first.payload) == {
        "outcome": "failed",
        "error": str(BUSY),
        "transient": True,
        "reason": "a newer user message drives the next turn",
    }
    assert (
        outcome_of(second.payload) == {"outcome": "completed"} and second.turn_id != first.turn_id
    )
    assert [e.payload["attempt"] for e in h.events("continuation")] == [1]


def test_a_release_during_the_wait_leaves_the_turn_to_the_next_owner(store: Store) -> None:
    h = Harness(store, Scripted(BUSY))

    async def go() -> None:
        h.runner.start()
        await h.waiting()
        h.runner.release()
        assert h.runner.task is not None
        await asyncio.wait_for(h.runner.task, 30)

    asyncio.run(go())
    info = store.sessions.get(h.sid)
    assert h.ended() is None and info.active_turn_id is not None
    assert (info.owner, info.attempt_count) == (None, 3)  # released; attempt 2 stays charged
