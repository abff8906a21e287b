"""The live output of turns as the workers send it: which deltas went missing.

A worker numbers the deltas of a turn from 0 (`control.Delta.index`) and drops one rather
than wait when its queue to the supervisor is full. So a delta that skips numbers tells
how many were lost on the way, which the pool counts (`turnkeeper_deltas_dropped_total
{where="worker"}`). A delta numbered at or below one already seen is a new start (the
turn went on with another worker after a crash or a handoff, or the same worker began it
again): it is passed on like any other, and counting starts again from it.

Pure: no I/O, no clock. One entry per session with a turn streaming, forgotten when the
turn ends or the session leaves its worker.
"""

from __future__ import annotations


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
