"""A turn's live output: the text a model streams, sent to the supervisor as `delta`s.

The committed `model_response` is the durable answer; deltas only let whoever is attached
watch it being written. So they are cheap and safe to lose:

- `Coalescer` (pure, time passed in) cuts what the model streams into pieces: at most
  one a turn per `DELTA_INTERVAL` (text streamed meanwhile waits and goes whole in the
  next one), at most `MAX_DELTA` characters of text each (the rest goes in the next ones),
  a tool call the model makes in a piece of its own, so a UI can show it at once. The
  first piece of a turn goes at once: the time to the first delta is what a user waits.
  `finish` sends what waits when the model call ends, so the deltas of a call, joined,
  are its answer when none were dropped.
- `LiveOutput` carries a coalescer's pieces out: sent without ever waiting (a full queue
  to the supervisor drops the piece, counted; its index is spent all the same, so a
  reader sees the gap), and a timer sends text that waits when no more comes.

`index` counts a turn's deltas from 0 across its model calls; `elapsed` is the seconds
since the model call began (index 0's: the time to the first delta).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.control import DELTA_INTERVAL, MAX_DELTA


@dataclass(frozen=True)
class Piece:
    """One delta of a turn: `text`, or the name of a tool call (`tool_call`, text "")."""

    index: int
    text: str
    tool_call: str | None
    elapsed: float


class Coalescer:
    """Cuts one turn's streamed output into pieces; the rules are in the module docstring.

    Every method that may produce pieces takes the time (`now`, monotonic seconds) and
    returns the pieces to send now, in order; `due` says when `tick` has one to send.
    """

    def __init__(self, interval: float = DELTA_INTERVAL, limit: int = MAX_DELTA) -> None:
        self.interval = interval
        self.limit = limit
        self.index = 0  # the next piece's
        self.streamed = ""  # the text of the model call in flight, all of it so far
        self._began = 0.0  # when the model call in flight began
        self._sent_at: float | None = None  # when the latest piece went
        # What waits to go: text (merged as it comes) and tool calls, in order.
        self._waiting: deque[tuple[str, str | None]] = deque()

    def begin(self, now: float) -> None:
        """A model call of the turn begins: `elapsed` counts from now."""
        self._began = now
        self.streamed = ""

    def text(self, text: str, now: float) -> list[Piece]:
        """The model streamed `text`."""
        if not text:
            return []
        self.streamed += text
        if self._waiting and self._waiting[-1][1] is None:
            self._waiting[-1] = (self._waiting[-1][0] + text, None)
        else:
            self._waiting.append((text, None))
        return self.tick(now)

    def tool_call(self, name: str, now: float) -> list[Piece]:
        """The model calls the tool `name`."""
        self._waiting.append(("", name))
        return self.tick(now)

    def due(self) -> float | None:
        """When `tick` has a piece to send; None while nothing waits."""
        if not self._waiting:
            return None
        return self._began if self._sent_at is None else self._sent_at + self.interval

    def tick(self, now: float) -> list[Piece]:
        """The piece that may go now, if one waits and the interval has passed."""
        due = self.due()
        if due is None or now < due:
            return []
        return [self._next(now)]

    def finish(self, now: float) -> list[Piece]:
        """The model call ended: everything that waits, now (the answer is about to be
        committed, and deltas must not trail it)."""
        pieces = []
        while self._waiting:
            pieces.append(self._next(now))
        return pieces

    def _next(self, now: float) -> Piece:
        text, name = self._waiting.popleft()
        if len(text) > self.limit:
            text, rest = text[: self.limit], text[self.limit :]
            self._waiting.appendleft((rest, None))
        piece = Piece(self.index, text, name, max(0.0, now - self._began))
        self.index += 1
        self._sent_at = now
        return piece


Send = Callable[[Piece], bool]  # sends a piece without waiting; False: it was dropped


class LiveOutput:
    """One turn's live output, sent as it comes (the `Stream` its model calls are handed).

    `send` must never wait: a piece it cannot send now is dropped (and counted here).
    """

    def __init__(self, send: Send, clock: Clock = SYSTEM, coalescer: Coalescer | None = None):
        self._send = send
        self._clock = clock
        self.coalescer = coalescer if coalescer is not None else Coalescer()
        self.sent = 0
        self.dropped = 0
        self._timer: asyncio.Task[None] | None = None

    @property
    def streamed(self) -> str:
        """The text the model call in flight streamed so far (for a cut answer)."""
        return self.coalescer.streamed

    def begin(self) -> None:
        """A model call begins."""
        self.coalescer.begin(self._clock.monotonic())

    def text(self, text: str) -> None:
        """The model streamed `text` (a `Stream`'s method)."""
        self._out(self.coalescer.text(text, self._clock.monotonic()))

    def tool_call(self, name: str) -> None:
        """The model calls the tool `name` (a `Stream`'s method)."""
        self._out(self.coalescer.tool_call(name, self._clock.monotonic()))

    def finish(self) -> None:
        """The model call ended (answered, failed or cut): what waits goes now."""
        self._cancel_timer()
        self._out(self.coalescer.finish(self._clock.monotonic()))

    async def _wait(self, delay: float) -> None:
        await self._clock.sleep(delay)
        self._timer = None
        self._out(self.coalescer.tick(self._clock.monotonic()))

    def _out(self, pieces: list[Piece]) -> None:
        for piece in pieces:
            if self._send(piece):
                self.sent += 1
            else:
                self.dropped += 1
        self._arm()

    def _arm(self) -> None:
        """A timer for the text that waits, so it goes even when no more comes."""
        due = self.coalescer.due()
        if due is None or self._timer is not None:
            return
        delay = max(0.0, due - self._clock.monotonic())
        self._timer = spawn(self._wait(delay), name="live-output")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
