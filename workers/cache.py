"""The session logs a worker keeps in memory, so that a turn reads only what is new.

A worker reads a session's whole log once, when it is assigned the session (a runner is
made, or a new lease token arrives), and from then on only the events after the last
seq it has. Events the worker commits itself and user messages committed by intake both
come back that way. The seqs of a session are contiguous: a read that does not follow on
from the cached log drops it, and the log is read in full again.

The logs share one memory budget per worker. When their estimated size passes it, the
logs of sessions not in a turn are evicted, least recently used first; an evicted
session is read in full at its next turn. Pure code: the runner does the reading.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from supervisor.contract.sections import PoolConfig
from supervisor.core.vocabulary import EventType
from supervisor.store import EventRecord
from workers.budget import session_spent
from workers.context import Summary, ratio_of
from workers.history import Calls, Conversation, MissingResult
from workers.models import Message

# An event held in memory costs its record, its payload's objects and its message: about
# this much besides the text of its payload (tracemalloc, short events: ~960 bytes).
EVENT_OVERHEAD = 1000
_COMPACTION, _MODEL = EventType.COMPACTION, EventType.MODEL_RESPONSE
_STARTED = EventType.TURN_STARTED
_RUNNING_TOTALS = frozenset((EventType.TURN_ENDED, EventType.COMPACTION))
DEFAULT_BUDGET = PoolConfig.model_fields["history_cache_mb"].default * 2**20  # bytes


def event_size(event: EventRecord) -> int:
    """What keeping `event` costs, estimated: a fixed part, then each payload value's
    length as text (a string's own length; a list or an object's JSON length)."""
    size = EVENT_OVERHEAD
    for value in event.payload.values():
        if isinstance(value, str):
            size += len(value)
        elif value and isinstance(value, list | dict):
            size += len(json.dumps(value, ensure_ascii=False, default=str))
        else:
            size += 8
    return size


class SessionLog(list[EventRecord]):
    """One session's events, oldest first, as far as the worker has read them, and what is
    built of them. A list, so it goes wherever the events do; it grows by `add` only.

    `token` is the lease token the log was read under: a log of another token is stale.
    A `compaction` event read in makes its summary the log's start (`summary`): the events
    it stands for are let go, so a log holds what the next prompt needs and no more
    (`workers.context`). `ratio` is the newest server count over estimate of a prompt.
    """

    def __init__(self, events: Iterable[EventRecord] = (), token: int = 0) -> None:
        super().__init__()
        self.token = token
        self.size = 0  # estimated bytes
        self.summary: Summary | None = None
        self.ratio = 1.0
        self.session_tokens = 0  # spent by the session's ended turns (`workers.budget`)
        self.last_started: str | None = None  # the turn of the newest `turn_started`
        self._conversation = Conversation()
        self._calls = Calls()
        self._extend(list(events))

    @property
    def last_seq(self) -> int:
        """The seq of the newest event held; 0 for an empty log."""
        return self[-1].seq if self else 0

    def add(self, new: Sequence[EventRecord]) -> bool:
        """Append events read after `last_seq`; False, adding nothing, on a gap in the seqs."""
        if not new:
            return True
        expected = self.last_seq + 1
        for event in new:
            if event.seq != expected:
                return False
            expected += 1
        self._extend(new)
        return True

    def _extend(self, new: Sequence[EventRecord]) -> None:
        summary = self.summary
        for event in new:
            if event.type == _COMPACTION:
                found = Summary.of(event)
                if found is not None and (summary is None or found.to_seq > summary.to_seq):
                    summary = found
            elif event.type == _MODEL:
                self.ratio = ratio_of(event.payload) or self.ratio
            if event.type == _STARTED:
                self.last_started = event.turn_id
            if event.type in _RUNNING_TOTALS:
                spent = session_spent(event.payload)
                self.session_tokens = self.session_tokens if spent is None else spent
            if not self._conversation.follows(event):
                self._conversation = Conversation()  # built again from the start, once
            self._calls.add(event)
            self.size += event_size(event)
        self.extend(new)
        if summary is not self.summary:
            assert summary is not None
            self._rebase(summary)
        self._conversation.advance(self)

    def _rebase(self, summary: Summary) -> None:
        """Start the log at `summary`: the events it stands for are let go."""
        self.summary = summary
        keep = next((i for i, e in enumerate(self) if e.seq > summary.to_seq), len(self))
        del self[:keep]
        self._conversation, self._calls = Conversation(), Calls()
        self.size = 0
        for event in self:
            self._calls.add(event)
            self.size += event_size(event)

    def messages(self, extra: Sequence[EventRecord] = (), turn: str = "") -> list[Message]:
        """`history.to_messages` of the log and `extra` (or of what `turn` read of them),
        after the summary of the newest compaction, if there is one."""
        built = self._conversation.messages(self, extra, turn)
        return built if self.summary is None else [self.summary.message(), *built]

    def missing_results(self) -> list[MissingResult]:
        """`history.missing_results` of the log."""
        return self._calls.missing()


def log_of(events: Sequence[EventRecord]) -> SessionLog:
    """`events` as a SessionLog: itself if it is one, else a log built of them."""
    return events if isinstance(events, SessionLog) else SessionLog(events)


class HistoryCache:
    """The logs of one worker's sessions, within a memory budget (bytes, estimated)."""

    def __init__(self, budget: int = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self._logs: OrderedDict[str, SessionLog] = OrderedDict()  # least recently used first
        self._busy: set[str] = set()  # sessions in a turn: never evicted

    def get(self, session_id: str, token: int) -> SessionLog | None:
        """The session's log read under `token`; a log of another token is dropped."""
        log = self._logs.get(session_id)
        if log is None:
            return None
        if log.token != token:
            self.drop(session_id)
            return None
        self._logs.move_to_end(session_id)
        return log

    def put(self, session_id: str, log: SessionLog) -> None:
        """Keep `log` as the session's log, the most recently used."""
        self._logs[session_id] = log
        self._logs.move_to_end(session_id)

    def drop(self, session_id: str) -> None:
        """Forget the session's log: its next read is a whole one."""
        self._logs.pop(session_id, None)

    def hold(self, session_id: str, busy: bool) -> None:
        """Mark the session in a turn (never evicted) or not."""
        if busy:
            self._busy.add(session_id)
        else:
            self._busy.discard(session_id)

    @property
    def size(self) -> int:
        """The estimated bytes of every log kept."""
        return sum(log.size for log in self._logs.values())

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._logs

    def trim(self, keep: str = "") -> list[str]:
        """Evict logs of sessions not in a turn, least recently used first, until the
        total fits the budget; `keep` (the log just read) stays. Returns the evicted ids."""
        total = self.size
        evicted: list[str] = []
        for session_id in list(self._logs):
            if total <= self.budget:
                break
            if session_id == keep or session_id in self._busy:
                continue
            total -= self._logs.pop(session_id).size
            evicted.append(session_id)
        return evicted
