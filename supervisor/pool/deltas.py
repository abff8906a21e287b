"""The live output of turns as the workers send it: which deltas went missing.

A worker numbers the deltas of a turn from 0 (`control.Delta.index`) and drops one rather
than wait when its queue to the supervisor is full. So a delta that skips numbers tells
how many were lost on the way, which the pool counts (`turnkeeper_deltas_dropped_total
{where="worker"}`). A delta numbered at or below one already seen is a new start (the
turn went on with another worker after a crash or a handoff, or the same worker began it
again): it is passed on like any other, and counting starts again from it.

The text streamed since the turn's last committed `model_response` is kept too
(`StreamedText`), up to `MAX_STREAMED` characters: an operator's interrupt ends the turn
in the database before its worker hears of it, so the interrupt's own transaction
commits that text as the cut answer the user watched being written.

Pure: no I/O, no clock. One entry per session with a turn streaming, forgotten when the
turn ends or the session leaves its worker.
"""

from __future__ import annotations

MAX_STREAMED = 1 << 20  # characters of one model call's streamed text kept for a cut


class DeltaIndexes:
    """The next delta index expected of each session's turn, per worker."""

    def __init__(self) -> None:
        self._next: dict[str, tuple[str, str, int]] = {}  # session -> (worker, turn, index)

    def missed(self, worker: str, session: str, turn: str, index: int) -> int:
        """Record delta `index` of `turn`, sent by `worker`; how many before it never came."""
        known = self._next.get(session)
        expected = known[2] if known is not None and known[:2] == (worker, turn) else 0
        self._next[session] = (worker, turn, index + 1)
        return max(index - expected, 0)

    def forget(self, session: str) -> None:
        """The session's turn ended, or the session left its worker."""
        self._next.pop(session, None)

    def __len__(self) -> int:
        return len(self._next)


class StreamedText:
    """The text each session's turn streamed since its last committed answer."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[str, list[str], int, bool]] = {}

    def add(self, session: str, turn: str, text: str, *, missed: int = 0) -> None:
        """Delta text of `turn`; `missed`: deltas lost before it."""
        known = self._parts.get(session)
        if known is None or known[0] != turn:
            known = (turn, [], 0, True)
        _, parts, size, complete = known
        complete = complete and not missed
        if size + len(text) > MAX_STREAMED:
            text, complete = text[: MAX_STREAMED - size], False
        parts.append(text)
        self._parts[session] = (turn, parts, size + len(text), complete)

    def answered(self, session: str) -> None:
        """The turn's answer was committed: what streams next is the next model call's."""
        self._parts.pop(session, None)

    forget = answered  # the turn ended, or the session left its worker

    def get(self, session: str) -> tuple[str, str, bool] | None:
        """What the session's turn streamed since its last answer: its turn id, the text,
        and whether it is whole (no delta lost, not past `MAX_STREAMED`); None if nothing."""
        known = self._parts.get(session)
        if known is None or not known[2]:
            return None
        return known[0], "".join(known[1]), known[3]
