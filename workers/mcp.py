"""MCP tool servers as a `Toolbox`: one supervised stdio child per configured server.

Each server (`[[mcp.servers]]`) is started by the worker in its own process group over a
transport turnkeeper owns (`workers.mcp_transport`), with a minimal environment: PATH,
HOME, LANG, LC_ALL, TZ, USER and LOGNAME when set, plus exactly the variables its `env`
setting names. The worker's own variables (NOTIFY_SOCKET, TURNKEEPER_*, API keys, tokens)
never reach it. The official SDK's `ClientSession` speaks MCP over that transport.

A server that dies is restarted after 0.5 s, doubling to 30 s; 5 crashes within 60 s mark
it DOWN, and its tools answer "unavailable" until the workers are restarted. A tool call
never raises: a timeout, a protocol error or a server dying mid-call is an error outcome
the model can read. MCP tool annotations are kept: `readOnlyHint` -> `read_only`,
`idempotentHint` -> `idempotent`.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types
from loguru import logger
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError

from supervisor import __version__
from supervisor.contract.config import McpServer
from supervisor.contract.reaper import ProcessId
from workers.mcp_transport import ServerProcess, child_environment
from workers.models import ToolSpec
from workers.tools import ToolOutcome

OnStart = Callable[[str, int, float, int], Awaitable[Any]]
"""Called with (server name, pid, psutil create_time, pgid) once a server process runs."""
OnExit = Callable[[str, int], Awaitable[Any]]
"""Called with (server name, pid) once that process and its group are gone."""
Clock = Callable[[], float]

ORPHAN_GRACE = 0.5
"""Seconds the rest of a group gets after SIGTERM, once its server exited on its own."""
CLIENT_INFO = mcp_types.Implementation(name="turnkeeper", version=__version__)


@dataclass
class RestartPolicy:
    """When to restart a crashed server, and when to give up on it (pure: no I/O).

    The delay starts at `first_delay` and doubles, up to `max_delay`, with each crash in a
    row; a run that lasted `stable_after` seconds starts the row anew. `max_crashes`
    crashes within `window` seconds give up: `crashed` returns None, for good.
    """

    clock: Clock = time.monotonic
    first_delay: float = 0.5
    max_delay: float = 30.0
    max_crashes: int = 5
    window: float = 60.0
    stable_after: float = 60.0
    down: bool = field(default=False, init=False)
    _crashes: list[float] = field(default_factory=list, init=False, repr=False)
    _in_a_row: int = field(default=0, init=False, repr=False)
    _started_at: float | None = field(default=None, init=False, repr=False)

    def started(self) -> None:
        """The server is up and answering."""
        self._started_at = self.clock()

    def crashed(self) -> float | None:
        """The server died or failed to start: seconds to wait before the next start, or None."""
        now = self.clock()
        if self._started_at is not None and now - self._started_at >= self.stable_after:
            self._in_a_row = 0
        self._started_at = None
        self._crashes = [t for t in self._crashes if now - t < self.window] + [now]
        if self.down or len(self._crashes) >= self.max_crashes:
            self.down = True
            return None
        delay = min(self.max_delay, self.first_delay * 2**self._in_a_row)
        self._in_a_row += 1
        return delay


class ServerState(enum.Enum):
    """Where a server is in its life."""

    NEW = "new"  # start() not called yet
    STARTING = "starting"  # spawned, initializing and listing its tools
    READY = "ready"  # answering calls
    BACKOFF = "backoff"  # died or failed to start; restarted after a delay
    DOWN = "down"  # crashed too often; unavailable until the workers restart
    STOPPED = "stopped"  # closed by the worker


def _content_text(block: mcp_types.ContentBlock) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        return f"[{block.type} {block.mime_type}, {len(block.data)} bytes of base64]"
    if isinstance(block, mcp_types.ResourceLink):
        return f"[resource {block.uri}]"
    resource = block.resource
    if isinstance(resource, mcp_types.TextResourceContents):
        return resource.text
    return f"[resource {resource.uri}, {resource.mime_type or 'binary'}]"


def outcome_of(result: mcp_types.CallToolResult) -> ToolOutcome:
    """The text of a tool result's content items, joined by newlines, and its isError."""
    parts = [_content_text(block) for block in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content, ensure_ascii=False)]
    return ToolOutcome("\n".join(parts), is_error=result.is_error)


def _error(text: str) -> ToolOutcome:
    return ToolOutcome(text, is_error=True)


class McpServerClient:
    """One configured MCP server: its process, its session, its restarts and its calls."""

    def __init__(
        self,
        config: McpServer,
        *,
        on_start: OnStart | None = None,
        on_exit: OnExit | None = None,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.state = ServerState.NEW
        self.tools: list[mcp_types.Tool] = []
        """The last listing; kept while the server restarts or is down."""
        self.process: ServerProcess | None = None
        self.policy = policy or RestartPolicy()
        self.log = logger.bind(subsystem="mcp", server=config.name)
        self._on_start = on_start
        self._on_exit = on_exit
        self._session: ClientSession | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._cleanup: asyncio.Task[None] | None = None
        self._deadline: float | None = None

    def _set_state(self, state: ServerState) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    async def start(self) -> bool:
        """Start the server and keep it running; True if the first start succeeded.

        A failed start is logged and retried in the background; it never raises.
        """
        if self._task is None:
            self._set_state(ServerState.STARTING)
            self._task = asyncio.create_task(self._supervise(), name=f"mcp:{self.name}")
        while self.state is ServerState.STARTING:
            await self._changed.wait()
        return self.state is ServerState.READY

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the server to answer calls; False if it is not."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self.state in (ServerState.STARTING, ServerState.BACKOFF):
            try:
                await asyncio.wait_for(self._changed.wait(), until - loop.time())
            except TimeoutError:
                break
        return self.state is ServerState.READY

    async def stop(self, deadline: float) -> None:
        """Stop the server's process group: SIGTERM now, SIGKILL at `deadline` (loop time)."""
        self._deadline = deadline
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._cleanup is not None:
            await self._cleanup
        self._set_state(ServerState.STOPPED)

    async def _supervise(self) -> None:
        while True:
            self._set_state(ServerState.STARTING)
            try:
                reason = await self._run_once()
            except Exception as exc:  # a bug: counted as a crash, not fatal to the worker
                self.log.opt(exception=exc).error("MCP server {!r}: unexpected error", self.name)
                reason = f"failed: {exc!r}"
            delay = self.policy.crashed()
            if delay is None:
                self.log.error(
                    "MCP server {!r} {}; it failed {} times within {:g} s and is DOWN until "
                    "the workers restart",
                    self.name,
                    reason,
                    self.policy.max_crashes,
                    self.policy.window,
                )
                self._set_state(ServerState.DOWN)
                return
            self.log.warning("MCP server {!r} {}; restarting in {:g} s", self.name, reason, delay)
            self._set_state(ServerState.BACKOFF)
            await asyncio.sleep(delay)

    async def _run_once(self) -> str:
        """One life of the server process; returns how it ended, for the log."""
        config = self.config
        env = child_environment(config.env)
        try:
            process = await ServerProcess.spawn(self.name, config.command, env, config.cwd)
        except OSError as exc:
            return f"cannot be started: command {config.command[0]!r}: {exc.strerror or exc}"
        self.process = process
        identity = ProcessId.of(process.pid)
        try:
            if identity is not None and self._on_start is not None:
                await self._callback(
                    self._on_start, self.name, process.pid, identity.create_time, process.pgid
                )
            return await self._serve(process)
        finally:
            self._session = None
            # A task of its own, which `stop` awaits: a cancellation arriving while the
            # group is being stopped must neither cut that short nor skip `on_exit`.
            self._cleanup = asyncio.create_task(self._stop_process(process, identity))
            await asyncio.shield(self._cleanup)

    async def _stop_process(self, process: ServerProcess, identity: ProcessId | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = self._deadline if self._deadline is not None else loop.time() + ORPHAN_GRACE
        await process.terminate(deadline)
        if identity is not None and self._on_exit is not None:
            await self._callback(self._on_exit, self.name, process.pid)

    async def _serve(self, process: ServerProcess) -> str:
        """Run the session until the connection ends; returns how it ended, for the log."""
        try:
            async with ClientSession(
                process.incoming, process.outgoing, client_info=CLIENT_INFO
            ) as session:
                # Failures are caught in here: the session's task group would wrap them.
                failure = await self._handshake(session, process)
                if failure is not None:
                    return failure
                self._session = session
                self.policy.started()
                self._set_state(ServerState.READY)
                self.log.info(
                    "MCP server {!r} ready (pid {}): {}",
                    self.name,
                    process.pid,
                    ", ".join(tool.name for tool in self.tools) or "no tools",
                )
                await process.closed.wait()
                self._session = None
                self._set_state(ServerState.BACKOFF)
        except Exception as exc:  # a task of the SDK's session failed
            return f"lost its session: {exc!r}"
        await process.wait_exit(ORPHAN_GRACE)
        return f"exited ({process.describe_exit()})"

    async def _handshake(self, session: ClientSession, process: ServerProcess) -> str | None:
        """Initialize and list the tools within `start_timeout`; None, or what failed."""
        timeout = self.config.start_timeout
        try:
            with anyio.fail_after(timeout):
                await session.initialize()
                self.tools = await _list_tools(session)
        except TimeoutError:
            return f"did not finish starting within {timeout:g} s (start_timeout)"
        except MCPError as exc:
            if process.closed.is_set():
                await process.wait_exit(ORPHAN_GRACE)
                return f"exited while starting ({process.describe_exit()})"
            return f"failed to start: {exc.message} (JSON-RPC error {exc.code})"
        except Exception as exc:  # an answer the SDK rejected
            return f"failed to start: {exc!r}"
        return None

    async def _callback(self, callback: Callable[..., Awaitable[Any]], *args: Any) -> None:
        try:
            await callback(*args)
        except Exception as exc:  # the registry is for sweeping; the server runs on
            self.log.warning("MCP server {!r}: process callback failed: {!r}", self.name, exc)

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call `tool` within `call_timeout`; every failure is an error outcome."""
        if self.state is ServerState.DOWN:
            return _error(
                f"the MCP server {self.name!r} is unavailable: it crashed "
                f"{self.policy.max_crashes} times within {self.policy.window:g} s"
            )
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.call_timeout
        session, process = self._session, self.process
        if session is None and await self.wait_ready(self.config.call_timeout):
            session, process = self._session, self.process
        if session is None or process is None:
            if self.state in (ServerState.STARTING, ServerState.BACKOFF):
                return _error(
                    f"the MCP server {self.name!r} is restarting and was not ready within "
                    f"{self.config.call_timeout:g} s; try again later"
                )
            return _error(f"the MCP server {self.name!r} is not running ({self.state.value})")
        timeout = max(until - loop.time(), 0.001)
        try:
            result = await session.call_tool(tool, arguments, read_timeout_seconds=timeout)
        except MCPError as exc:
            if exc.code == mcp_types.REQUEST_TIMEOUT:
                return _error(
                    f"the MCP tool {tool!r} of server {self.name!r} did not answer within "
                    f"{self.config.call_timeout:g} s; it was cancelled and may or may not "
                    "have taken effect"
                )
            if exc.code == mcp_types.CONNECTION_CLOSED:
                return await self._lost(process)
            return _error(f"the MCP server {self.name!r} refused the call: {exc.message}")
        except Exception as exc:  # an answer the SDK cannot parse or validate
            self.log.warning("MCP server {!r}: unreadable answer to {}: {!r}", self.name, tool, exc)
            return _error(f"the MCP server {self.name!r} gave an unreadable answer: {exc}")
        return outcome_of(result)

    async def _lost(self, process: ServerProcess) -> ToolOutcome:
        if self._deadline is not None:
            return _error(f"the MCP server {self.name!r} was stopped during the call")
        await process.wait_exit(ORPHAN_GRACE)
        how = (
            "closed the connection"
            if process.returncode is None
            else f"exited ({process.describe_exit()})"
        )
        return _error(f"the MCP server {self.name!r} {how} during the call; it is being restarted")


async def _list_tools(session: ClientSession) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


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
    ) -> None:
        self.clients = [
            McpServerClient(server, on_start=on_start, on_exit=on_exit, policy=policy())
            for server in servers
        ]
        self.reserved = frozenset(reserved)

    async def start(self) -> None:
        """Start every server at once; returns when each is ready or has failed once."""
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

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call the tool offered as `name`; errors are outcomes, not exceptions."""
        route = self._routes().get(name)
        if route is None:
            missing = [c.name for c in self.clients if not c.tools]
            note = f" (not started yet, tools unknown: {', '.join(missing)})" if missing else ""
            return _error(f"unknown tool {name!r}{note}")
        client, tool = route
        return await client.call(tool.name, arguments)

    async def aclose(self, grace: float) -> None:
        """Stop every server: SIGTERM to all groups at once, SIGKILL after `grace` s, reap."""
        deadline = asyncio.get_running_loop().time() + grace
        await asyncio.gather(*(client.stop(deadline) for client in self.clients))
