"""Tools the worker offers to agents.

`Toolbox` is the seam: the built-in tools below today, MCP servers' tools next to them.
A tool never raises into a turn: failures come back as an error result the model reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.contract.clock import SYSTEM
from workers.models import ToolSpec

MAX_RESULT_BYTES = 256 * 1024  # tools.max_result_bytes


def cut(text: str, limit: int) -> str:
    """`text` whole if its UTF-8 is at most `limit` bytes, else its first `limit` bytes (a
    character never split) and a note saying how much was cut."""
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")
    dropped = len(data) - len(kept.encode("utf-8", "surrogatepass"))
    return (
        f"{kept}\n[cut: {dropped:,} of {len(data):,} bytes not kept; "
        f"tools.max_result_bytes = {limit}]"
    )


@dataclass(frozen=True)
class ToolOutcome:
    """What a tool call returned: text for the model, and whether it is an error."""

    content: str
    is_error: bool = False


class Toolbox(Protocol):
    """The tools on offer in a worker."""

    def specs(self) -> list[ToolSpec]:
        """The tools, with their MCP hints."""
        ...

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run one tool; errors are outcomes, not exceptions."""
        ...


class BuiltinTools:
    """Two small tools that need nothing outside the worker, for demos and tests.

    `echo` returns its arguments as JSON; `sleep` waits `seconds` (at most 300).
    """

    SPECS = [
        ToolSpec(
            "echo",
            "Return the arguments, as JSON.",
            {"type": "object", "additionalProperties": True},
            read_only=True,
            idempotent=True,
        ),
        ToolSpec(
            "sleep",
            "Wait for `seconds` seconds, then say so.",
            {
                "type": "object",
                "properties": {"seconds": {"type": "number"}},
                "required": ["seconds"],
            },
            read_only=True,
            idempotent=True,
        ),
    ]

    def specs(self) -> list[ToolSpec]:
        """The built-in tools."""
        return list(self.SPECS)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run a built-in tool."""
        if name == "echo":
            return ToolOutcome(json.dumps(arguments, sort_keys=True, ensure_ascii=False))
        if name == "sleep":
            seconds = arguments.get("seconds")
            if not isinstance(seconds, int | float) or not 0 <= seconds <= 300:
                return ToolOutcome("seconds must be a number from 0 to 300", is_error=True)
            await SYSTEM.sleep(seconds)
            return ToolOutcome(f"slept {seconds} s")
        known = ", ".join(spec.name for spec in self.SPECS)
        return ToolOutcome(f"unknown tool {name!r}; known: {known}", is_error=True)


class Toolboxes:
    """Several toolboxes offered as one; a name offered twice goes to the first toolbox.

    A result longer than `max_result_bytes` (`tools.max_result_bytes`) of UTF-8 is cut
    there, with a note saying how much was cut: that is what the model reads and what is
    stored.
    """

    def __init__(self, *boxes: Toolbox, max_result_bytes: int = MAX_RESULT_BYTES) -> None:
        self.boxes = boxes
        self.max_result_bytes = max_result_bytes

    def specs(self) -> list[ToolSpec]:
        """The tools of every toolbox, without duplicate names."""
        seen: set[str] = set()
        specs = []
        for box in self.boxes:
            for spec in box.specs():
                if spec.name not in seen:
                    seen.add(spec.name)
                    specs.append(spec)
        return specs

    def server_of(self, name: str) -> str | None:
        """The MCP server that offers the tool `name`, if an MCP server does."""
        for box in self.boxes:
            if any(spec.name == name for spec in box.specs()):
                server_of = getattr(box, "server_of", None)
                return server_of(name) if server_of is not None else None
        return None

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run `name` in the first toolbox that offers it."""
        for box in self.boxes:
            if any(spec.name == name for spec in box.specs()):
                outcome = await box.call(name, arguments)
                return ToolOutcome(cut(outcome.content, self.max_result_bytes), outcome.is_error)
        known = ", ".join(spec.name for spec in self.specs())
        return ToolOutcome(f"unknown tool {name!r}; known: {known}", is_error=True)
