"""A turn's live output on the terminal: `send --wait` and `attach` print the text the
model streams as it comes, before its answer is committed.

Deltas are never stored, and a client may miss some (a stream that reconnects, a client
too slow for them): the committed `model_response` is what counts. So the text streamed
since the last committed event is kept. When the answer is committed, `send --wait`
prints of it only what the stream did not show: nothing if it showed the whole text, the
rest of the line if it showed a beginning of it (deltas missed at the end), else the
whole text on a line of its own. Committed lines always start a line of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import click


@dataclass
class Live:
    """What the live output printed since the last committed event."""

    streamed: str = ""  # text printed since the last committed event
    open_line: bool = False  # the last thing printed was streamed text, without a newline
    calls: list[str] = field(default_factory=list)  # tool calls announced since then

    def delta(self, delta: dict[str, Any]) -> None:
        """Print a delta: its text as is, or a line announcing its tool call."""
        name = delta.get("tool_call")
        if name:
            self.end_line()
            self.calls.append(str(name))
            click.echo(f"[calling {name}…]")
            return
        text = str(delta.get("text") or "")
        if text:
            click.echo(text, nl=False)
            self.streamed += text
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        """End the line streamed text left open, so what follows starts a line."""
        if self.open_line:
            click.echo("")
            self.open_line = False

    def shown(self, kind: str, payload: dict[str, Any]) -> bool:
        """A committed event: whether the stream showed it whole, once this printed what
        it missed of an answer it began (a tool call counts as shown if it announced it).
        Starts afresh for what follows."""
        streamed, self.streamed = self.streamed, ""
        text = payload.get("text")
        began = streamed and isinstance(text, str) and text.startswith(streamed)
        if kind == "model_response" and began:
            rest = str(text)[len(streamed) :]
            if rest:
                click.echo(rest, nl=not rest.endswith("\n"))
                self.open_line = False
            self.end_line()
            return True
        self.end_line()
        if kind == "tool_call" and payload.get("name") in self.calls:
            self.calls.remove(payload["name"])
            return True
        return False
