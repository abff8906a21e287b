"""MCP tool servers as a `Toolbox`: one supervised stdio child per configured server.

Each server (`[[mcp.servers]]`) is started by the worker in its own process group, first
thing when the worker starts (`workers.mcp_launch`: the servers' own starts overlap the
worker's), and connected to over a transport turnkeeper owns (`workers.mcp_transport`).
All servers start at once, and a worker says `ready` only once each is ready or has
failed its start once. They get a minimal environment: PATH, HOME, LANG, LC_ALL, TZ,
USER and LOGNAME when set, plus exactly the variables its `env` setting names. The
worker's own variables (NOTIFY_SOCKET, TURNKEEPER_*, API keys, tokens) never reach it.
The official SDK's `ClientSession` speaks MCP over that transport.

One server's life (restarts with the shared backoff, DOWN after too many crashes, calls
that never raise) is `workers.mcp_server`. Here: the servers together, and the names their
tools are offered under. MCP tool annotations are kept: `readOnlyHint` -> `read_only`,
`idempotentHint` -> `idempotent`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import mcp_types

from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import McpServer
from workers.mcp_launch import Launched
from workers.mcp_server import (
    McpServerClient,
    OnExit,
    OnStart,
    RestartPolicy,
    error_outcome,
    outcome_of,
)
from workers.models import ToolSpec
from workers.tools import ToolOutcome

__all__ = [
    "McpServerClient",
    "McpTools",
    "RestartPolicy",
    "function_name",
    "offered_names",
    "outcome_of",
]


_NOT_A_FUNCTION_NAME = re.compile(r"[^A-Za-z0-9_-]")


def function_name(name: str) -> str:
    """`name` made fit for an OpenAI function name (^[a-zA-Z0-9_-]{1,64}$)."""
    return _NOT_A_FUNCTION_NAME.sub("_", name)[:64] or "_"


def offered_names(
    listings: Iterable[tuple[str, Iterable[str]]], reserved: Iterable[str] = ()
) -> dict[str, tuple[str, str]]:
    """Name every (server, tool) for the model: offered name -> (server, tool).

    A tool keeps its server's name (made fit for a function name); if that is taken, by
    an earlier server or a `reserved` name, it is offered as `<server>__<tool>`, with a
    counter as the last resort.
    """
    taken = set(reserved)
    names: dict[str, tuple[str, str]] = {}
    for server, tools in listings:
        for tool in tools:
            name = function_name(tool)
            if name in taken:
                name = function_name(f"{server}__{tool}")
            base, count = name, 2
            while name in taken:
                suffix = f"_{count}"
                name, count = base[: 64 - len(suffix)] + suffix, count + 1
            taken.add(name)
            names[name] = (server, tool)
    return names


class McpTools:
    """The tools of every configured MCP server, as one `Toolbox`.

    Tools are offered under their servers' names; on a clash, the server configured later
    offers it as `<server>__<tool>`. A server that fails is restarted or marked DOWN on its
    own; the other servers and the worker carry on.
    """

    def __init__(
        self,
        servers: Sequence[McpServer],
        *,
        on_start: OnStart | None = None,
        on_exit: OnExit | None = None,
        reserved: Iterable[str] = (),
        policy: Callable[[], RestartPolicy] = RestartPolicy,
        launched: Mapping[str, Launched | OSError] | None = None,
    ) -> None:
        launched = launched or {}
        self.clients = [
            McpServerClient(
                server,
                on_start=on_start,
                on_exit=on_exit,
                policy=policy(),
                launched=launched.get(server.name),
            )
            for server in servers
        ]
        self.reserved = frozenset(reserved)

    async def start(self) -> None:
        """Start every server at once; returns when each is ready or has failed once.

        A server whose process is in `launched` (`workers.mcp_launch.launch_all`, started
        while the worker was still setting up) is connected to, not started again.
        """
        await asyncio.gather(*(client.start() for client in self.clients))

    def _routes(self) -> dict[str, tuple[McpServerClient, mcp_types.Tool]]:
        by_name = {client.name: client for client in self.clients}
        listings = [(c.name, [tool.name for tool in c.tools]) for c in self.clients]
        routes = {}
        for offered, (server, tool_name) in offered_names(listings, self.reserved).items():
            client = by_name[server]
            routes[offered] = (client, next(t for t in client.tools if t.name == tool_name))
        return routes

    def specs(self) -> list[ToolSpec]:
        """The tools of all servers that listed theirs, with their MCP hints."""
        specs = []
        for offered, (_, tool) in self._routes().items():
            hints = tool.annotations or mcp_types.ToolAnnotations()
            specs.append(
                ToolSpec(
                    offered,
                    tool.description or "",
                    tool.input_schema,
                    read_only=hints.read_only_hint is True,
                    idempotent=hints.idempotent_hint is True,
                )
            )
        return specs

    def server_of(self, name: str) -> str | None:
        """The name of the server that offers the tool `name`, if one does."""
        route = self._routes().get(name)
        return None if route is None else route[0].name

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call the tool offered as `name`; errors are outcomes, not exceptions."""
        route = self._routes().get(name)
        if route is None:
            missing = [c.name for c in self.clients if not c.tools]
            note = f" (not started yet, tools unknown: {', '.join(missing)})" if missing else ""
            return error_outcome(f"unknown tool {name!r}{note}")
        client, tool = route
        return await client.call(tool.name, arguments)

    async def aclose(self, grace: float) -> None:
        """Stop every server: SIGTERM to all groups at once, SIGKILL after `grace` s, reap."""
        deadline = SYSTEM.monotonic() + grace
        await asyncio.gather(*(client.stop(deadline) for client in self.clients))
