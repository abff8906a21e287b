"""Token budgets: what a turn and a session may spend on the model.

`budget.turn_tokens` and `budget.session_tokens` (0: no limit) count prompt and answer
tokens together, the server's counts where it reports them (`usage`), else the worker's
estimates. Before each model call the turn checks that the call, at the prompt's cost and
`max_tokens` for the answer, would not pass either budget; a call that would is not made,
and the turn ends `budget_exhausted` with a notice saying what was spent. What a turn
spent goes into its `turn_ended` (`tokens`: prompt, completion, the turn's total and the
session's running total), so the session's count survives restarts and compactions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.vocabulary import EventType
from supervisor.store import EventRecord


class BudgetExhausted(Exception):
    """The next model call would pass a token budget; the message says what was spent."""


@dataclass
class Spend:
    """Tokens spent: prompt and completion."""

    prompt: int = 0
    completion: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def add(self, prompt: int, completion: int) -> None:
        self.prompt += prompt
        self.completion += completion


@dataclass
class Budget:
    """One run of a turn's budget: `earlier` is what the turn spent before this run (a
    continuation), `session` what the session's ended turns spent."""

    turn_limit: int = 0
    session_limit: int = 0
    max_tokens: int = 0  # what the next answer may cost at most
    earlier: Spend = field(default_factory=Spend)
    session: int = 0
    spent: Spend = field(default_factory=Spend)  # this run's

    def turn_spend(self) -> Spend:
        """What the turn spent so far, every run of it."""
        return Spend(
            self.earlier.prompt + self.spent.prompt, self.earlier.completion + self.spent.completion
        )

    def check(self, next_call: int) -> None:
        """BudgetExhausted if a call costing about `next_call` tokens would pass a budget."""
        turn = self.turn_spend()
        for key, limit, used in (
            ("budget.turn_tokens", self.turn_limit, turn.total),
            ("budget.session_tokens", self.session_limit, self.session + turn.total),
        ):
            if limit and used + next_call > limit:
                raise BudgetExhausted(
                    f"the next model call (about {next_call} tokens) would pass {key} "
                    f"({limit}): this turn spent {turn.total} tokens ({turn.prompt} prompt, "
                    f"{turn.completion} completion), the session {self.session + turn.total}"
                )

    def payload(self) -> dict[str, Any]:
        """The `tokens` of the turn's `turn_ended`."""
        turn = self.turn_spend()
        return {
            "prompt": turn.prompt,
            "completion": turn.completion,
            "turn": turn.total,
            "session": self.session + turn.total,
        }


def spent_by(events: Sequence[EventRecord]) -> Spend:
    """What the model answers among `events` cost (a turn's events: its earlier runs)."""
    spend = Spend()
    for event in events:
        if event.type == EventType.MODEL_RESPONSE:
            spend.add(*answer_cost(event.payload))
    return spend


def answer_cost(payload: dict[str, Any]) -> tuple[int, int]:
    """(prompt, completion) tokens of a `model_response`: the server's counts, else the
    worker's estimates kept with it."""
    found = payload.get("usage")
    usage: dict[str, Any] = found if isinstance(found, dict) else {}
    prompt = _count(usage.get("prompt_tokens")) or _count(payload.get("prompt_estimate"))
    completion = _count(usage.get("completion_tokens")) or _count(payload.get("tokens"))
    return prompt, completion


def session_spent(payload: dict[str, Any]) -> int | None:
    """The session's running total a `turn_ended` or a `compaction` holds, if any."""
    tokens = payload.get("tokens")
    if isinstance(tokens, dict):
        return _count(tokens.get("session"))
    return _count(payload.get("session_tokens")) if "session_tokens" in payload else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
