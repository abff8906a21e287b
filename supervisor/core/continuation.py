"""A turn its own worker continues instead of ending it: the rules, as pure code.

A turn whose agent would end it `truncated` (the model's answer was cut by its token
limit) or `failed` on a model error that may pass (`ModelError.transient`: a timeout, a
429, a 5xx) is not ended by its worker but continued, as an interrupted turn is, within
the same attempts. `workers.continuation` carries it out:

1. `cause_of` and `goes_on` say whether the turn goes on, and the cause its note tells;
2. a user message queued meanwhile drives the next turn instead: the turn ends as it
   would have;
3. an attempt is charged in the session row before anything else (write-ahead), in the
   accounting recovery uses (`attempt_turn_id`, `attempt_count`): at most
   `len(recovery.attempt_delays)` continuation attempts per turn, whoever charges them,
   cleared by `turn_ended`. Past the last, the turn ends as it would have;
4. the attempt waits for its time, `recovery.next_attempt_at` from the start of the run
   that failed; a release, an interrupt or a stop cuts the wait short (whoever owns the
   session next continues the turn), and a user message queued meanwhile ends it as in 2;
5. a `continuation` note with the cause and the attempt (and the model's error) is
   committed, and the agent runs the turn again.

| the agent would end the turn   | the turn's tail (`Resume`)     | continued for |
|--------------------------------|--------------------------------|---------------|
| truncated                      | TRUNCATED: its last answer cut | max_tokens    |
| failed on a model error that   | not ANSWERED: no final answer  | model_error   |
| may pass                       |                                |               |
| anything else                  |                                | (it ends)     |

A worker killed during the wait has charged an attempt it never started. When the turn's
last step is then the note of the attempt before (`charged_after_note`), that note's run
did not die on it: it failed and its worker went on to wait. Recovery therefore does not
treat the tail as a note it would put a note on: it continues the turn with the attempts
left, and the row never counts more than the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from supervisor.core.tail import Resume, TailEvent
from supervisor.core.vocabulary import Cause, EventType, TurnOutcome


def cause_of(outcome: str, transient: bool) -> Cause | None:
    """The cause a turn the agent would end with `outcome` is continued for; None: it ends.

    `transient`: the turn failed on a model error that may pass.
    """
    if outcome == TurnOutcome.TRUNCATED:
        return Cause.MAX_TOKENS
    if outcome == TurnOutcome.FAILED and transient:
        return Cause.MODEL_ERROR
    return None


def goes_on(cause: Cause, tail: Resume) -> bool:
    """Whether the turn's committed events leave something to continue for `cause`.

    `tail`: how they stand (`supervisor.core.tail.resume_from`). A turn the agent called
    cut goes on only from an answer that is; a failed one only if it has no final answer.
    """
    if cause is Cause.MAX_TOKENS:
        return tail is Resume.TRUNCATED
    return tail is not Resume.ANSWERED


def attempts_charged(row: Any, turn_id: str | None) -> int:
    """The continuation attempts charged for `turn_id`: the session row's count (any
    object with `attempt_turn_id` and `attempt_count`) less the turn's first run."""
    if turn_id is None or row.attempt_turn_id != turn_id:
        return 0
    return max(0, int(row.attempt_count) - 1)


def charged_after_note(turn_events: Sequence[TailEvent], attempts: int) -> bool:
    """True when an attempt was charged after the turn's latest `continuation` note.

    `attempts`: the continuation attempts charged for the turn (the session row's count
    less the first run). A note carries the attempt it started; a note from before notes
    said so never counts as followed.
    """
    notes = [e for e in turn_events if e.type == EventType.CONTINUATION]
    if not notes:
        return False
    noted = notes[-1].payload.get("attempt")
    return isinstance(noted, int) and not isinstance(noted, bool) and noted < attempts
