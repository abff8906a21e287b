"""Model outages: a server that is down, answers 5xx or 429, or times out is waited out.

An outage is not a failed turn: the turn waits and calls again, with a growing delay (or
the one the server's `Retry-After` asks for), for up to `model.outage_budget` seconds from
the outage's start, without spending the turn's continuation attempts. The session gets
one `notice` when the wait starts; it holds the outage's start, so a worker killed during
the wait leaves the rest of the budget to the turn's continuation. Past the budget the
turn fails with the server's last error. `Health` is the worker's view of the model,
sent in its heartbeats: `/v1/status` and `turnkeeper_model_up` read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.core.vocabulary import EventType
from supervisor.store import EventRecord
from workers.models import ModelError

# Seconds between calls; the last one repeats. Steps chosen one by one, not the shared
# doubling backoff (`supervisor.core.backoff`): 15 s, not 16, before the 30 s that repeat.
DELAYS = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
NOTICE = "the model is unavailable; retrying"
OUTAGE_KEY = "outage_since"  # in the notice's payload


class Health:
    """Whether the model answers, as this worker's turns found it, and the tokens its
    answers cost (`take`) and the calls that failed (`take_errors`) since the last
    heartbeat."""

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.tokens = {"prompt": 0, "completion": 0}
        self.errors = {"transient": 0, "permanent": 0}

    def spent(self, prompt: int, completion: int) -> None:
        self.tokens["prompt"] += prompt
        self.tokens["completion"] += completion

    def take(self) -> dict[str, int]:
        """The tokens counted since the last take."""
        taken, self.tokens = self.tokens, {"prompt": 0, "completion": 0}
        return taken

    def failed(self, transient: bool) -> None:
        """A model call failed (`ModelError.transient` says which kind)."""
        self.errors["transient" if transient else "permanent"] += 1

    def take_errors(self) -> dict[str, int]:
        """The failed calls counted since the last take, by kind (none: empty)."""
        taken, self.errors = self.errors, {"transient": 0, "permanent": 0}
        return {kind: count for kind, count in taken.items() if count}

    def down(self, since: float) -> None:
        self.down_since = since if self.down_since is None else min(self.down_since, since)

    def up(self) -> None:
        self.down_since = None


@dataclass
class Outage:
    """One turn's wait for the model, up to `budget` seconds from `since`."""

    budget: float
    since: float | None = None  # the outage's start (a notice says so), if one is under way
    tries: int = 0

    def wait(self, error: ModelError, now: float) -> float | None:
        """Seconds to wait before calling again after `error`; None when the budget is
        spent (or the error is not an outage)."""
        if not error.transient:
            return None
        since = self.since if self.since is not None else now
        left = since + self.budget - now
        if left <= 0:
            return None
        delay = DELAYS[min(self.tries, len(DELAYS) - 1)]
        if error.retry_after is not None:
            delay = max(error.retry_after, 0.0)
        self.tries += 1
        return min(delay, left)

    def spent(self, error: ModelError) -> ModelError:
        """The error the turn fails with once the budget is spent: not transient, so no
        continuation tries the same again."""
        if self.since is None:
            return error
        return ModelError(
            f"{error} (the model was unavailable for model.outage_budget, {self.budget:g} s)"
        )


def outage_since(events: Sequence[EventRecord]) -> float | None:
    """The start of the outage a turn's `events` were waiting out when they stop: its
    notice's, if no model answer came after it."""
    since: float | None = None
    for event in events:
        value = event.payload.get(OUTAGE_KEY)
        if event.type == EventType.NOTICE and isinstance(value, int | float):
            since = float(value)
        elif event.type == EventType.MODEL_RESPONSE:
            since = None
    return since
