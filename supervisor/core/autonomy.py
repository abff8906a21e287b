"""Autonomous runs: a goal, a continuation prompt and budgets, kept in the event log.

Pure code: no database, no clock. A run is started by the session's first `checkpoint`
event (written with the session, in one transaction), which holds the goal, the prompt
and the budgets. After every turn the worker appends a `checkpoint` with the counters,
the stop reason and `next_wake_at`; while no budget is spent, it appends the prompt as
the next user message and the run goes on.

The counters are counted from the log each time, never carried in memory, so a crash
(of a worker or the daemon) cannot reset them: the newest checkpoint's counts (each
checkpoint sets the run out again, so that it needs no older event, which a compaction
may have let go) and the events after it. A turn counts once when its `turn_ended` is
committed, however many times it was continued; the tokens are those every model
response of the run reported, the answers a crash cut short included.

The run lock is the session's lease: one worker at a time writes the session, and a
holder that stopped renewing it for `lease.stale_after` (30 s) is taken over.

| after a turn                                   | stop reason  |
|------------------------------------------------|--------------|
| the turn failed                                | `failed`     |
| its final answer contains `[goal met]`         | `goal_met`   |
| `max_turns` turns have ended                   | `max_turns`  |
| `max_tokens` tokens were used                  | `max_tokens` |
| the wall-clock deadline has passed             | `deadline`   |
| otherwise                                      | none: go on  |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

GOAL_MET = "[goal met]"  # an answer containing this ends the run


class RunEvent(Protocol):
    """What is read of an event (a `supervisor.store.EventRecord`)."""

    @property
    def seq(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def payload(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Run:
    """The run as its first checkpoint set it out."""

    goal: str
    prompt: str
    max_turns: int
    max_tokens: int | None
    deadline_at: float | None

    def start_payload(self, now: float) -> dict[str, Any]:
        """The first checkpoint."""
        return {
            "goal": self.goal,
            "prompt": self.prompt,
            "budgets": {
                "max_turns": self.max_turns,
                "max_tokens": self.max_tokens,
                "deadline_at": self.deadline_at,
            },
            "turns": 0,
            "tokens": 0,
            "stop_reason": None,
            "next_wake_at": now,
        }


def run_of(events: Sequence[RunEvent]) -> tuple[Run, int] | None:
    """The run and the seq of its newest checkpoint that sets it out (each does, the
    first one too); None for a session without one."""
    for event in reversed(events):
        if event.type == "checkpoint" and "budgets" in event.payload:
            p, b = event.payload, event.payload["budgets"]
            run = Run(
                goal=str(p.get("goal", "")),
                prompt=str(p.get("prompt", "")),
                max_turns=int(b["max_turns"]),
                max_tokens=None if b.get("max_tokens") is None else int(b["max_tokens"]),
                deadline_at=None if b.get("deadline_at") is None else float(b["deadline_at"]),
            )
            return run, event.seq
    return None


def last_checkpoint(events: Sequence[RunEvent]) -> dict[str, Any] | None:
    """The payload of the newest checkpoint."""
    for event in reversed(events):
        if event.type == "checkpoint":
            return event.payload
    return None


def progress(events: Sequence[RunEvent], now: float) -> dict[str, Any] | None:
    """The checkpoint to write after a turn ended: counters, stop reason, next wake.

    `events` is the session's whole log, oldest first. None if it holds no run.
    """
    found = run_of(events)
    if found is None:
        return None
    run, since = found
    at = next(i for i, e in enumerate(events) if e.seq == since)
    counted, after = events[at].payload, events[at + 1 :]
    ended = [e for e in after if e.type == "turn_ended"]
    answers = [e for e in after if e.type == "model_response"]
    tokens = int(counted.get("tokens") or 0) + sum(_tokens(e.payload.get("usage")) for e in answers)
    turns = int(counted.get("turns") or 0) + len(ended)
    last_answer = next((e for e in reversed(answers) if not e.payload.get("tool_calls")), None)
    stop: str | None = None
    if ended and ended[-1].payload.get("outcome") not in ("completed", "truncated"):
        stop = "failed"
    elif last_answer is not None and GOAL_MET in str(last_answer.payload.get("text", "")).lower():
        stop = "goal_met"
    elif turns >= run.max_turns:
        stop = "max_turns"
    elif run.max_tokens is not None and tokens >= run.max_tokens:
        stop = "max_tokens"
    elif run.deadline_at is not None and now >= run.deadline_at:
        stop = "deadline"
    return {
        "goal": run.goal,
        "prompt": run.prompt,  # so that resuming needs only the log's tail
        "budgets": {
            "max_turns": run.max_turns,
            "max_tokens": run.max_tokens,
            "deadline_at": run.deadline_at,
        },
        "turns": turns,
        "tokens": tokens,
        "stop_reason": stop,
        "next_wake_at": None if stop else now,
    }


def unfinished(events: Sequence[RunEvent]) -> bool:
    """True when the run has not stopped: it should go on (after a restart, say)."""
    last = last_checkpoint(events)
    return last is not None and last.get("stop_reason") is None


def _tokens(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
