"""One MCP server as a worker runs it: its process, its session, its restarts, its calls.

A server that dies is restarted after the shared backoff (`supervisor.core.backoff`:
0.5 s, doubling to 30 s); `max_crashes` crashes within `window` seconds mark it DOWN, and
its tools answer "unavailable" until the workers are restarted. A tool call never raises:
a timeout, a protocol error or a server dying mid-call is an error outcome the model can
read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import mcp_types
from loguru import logger
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError

from supervisor import __version__
from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM
from supervisor.contract.config import McpServer
from supervisor.contract.reaper import ProcessId
from supervisor.core.backoff import DEFAULT_BACKOFF, Backoff
from supervisor.core.vocabulary import McpState
from workers.mcp_launch import Launched, launch_server
from workers.mcp_transport import ServerProcess
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

    The wait after each crash in a row is the shared `backoff`'s; a run that it deems
    healthy starts the row anew. `max_crashes` crashes within `window` seconds give up:
    `crashed` returns None, for good.
    """

    clock: Clock = SYSTEM.monotonic
    backoff: Backoff = DEFAULT_BACKOFF
    max_crashes: int = 5
    window: float = 60.0
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
        if self._started_at is not None and self.backoff.forgives(now - self._started_at):
            self._in_a_row = 0
        self._started_at = None
        self._crashes = [t for t in self._crashes if now - t < self.window] + [now]
        if self.down or len(self._crashes) >= self.max_crashes:
            self.down = True
            return None
        self._in_a_row += 1
        return self.backoff.delay(self._in_a_row)


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


def error_outcome(text: str) -> ToolOutcome:
    """A tool outcome the model reads as an error."""
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
        launched: Launched | OSError | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.state = McpState.NEW
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
        # The process of the first life, started before the SDK was imported (or why it
        # could not be); later lives start their own.
        self._launched = launched

    def _set_state(self, state: McpState) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    async def start(self) -> bool:
        """Start the server and keep it running; True if the first start succeeded.

        A failed start is logged and retried in the background; it never raises.
        """
        if self._task is None:
            self._set_state(McpState.STARTING)
            self._task = spawn(self._supervise(), name=f"mcp:{self.name}")
        while self.state is McpState.STARTING:
            await self._changed.wait()
        return self.state is McpState.READY

    async def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the server to answer calls; False if it is not."""
        until = SYSTEM.monotonic() + timeout
        while self.state in (McpState.STARTING, McpState.BACKOFF):
            try:
                await asyncio.wait_for(self._changed.wait(), until - SYSTEM.monotonic())
            except TimeoutError:
                break
        return self.state is McpState.READY

    async def stop(self, deadline: float) -> None:
        """Stop the server's process group: SIGTERM now, SIGKILL at `deadline` (monotonic)."""
        self._deadline = deadline
        if isinstance(self._launched, Launched):  # never started: never connected to
            self._launched.discard()
            self._launched = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._cleanup is not None:
            await self._cleanup
        self._set_state(McpState.STOPPED)

    async def _supervise(self) -> None:
        while True:
            self._set_state(McpState.STARTING)
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
                self._set_state(McpState.DOWN)
                return
            self.log.warning("MCP server {!r} {}; restarting in {:g} s", self.name, reason, delay)
            self._set_state(McpState.BACKOFF)
            await SYSTEM.sleep(delay)

    async def _run_once(self) -> str:
        """One life of the server process; returns how it ended, for the log."""
        config = self.config
        launched, self._launched = self._launched, None
        try:
            if isinstance(launched, OSError):
                raise launched
            if launched is None:
                launched = await launch_server(config)
            process = await ServerProcess.attach(self.name, launched)
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
            self._cleanup = spawn(self._stop_process(process, identity), name="mcp-stop")
            await asyncio.shield(self._cleanup)

    async def _stop_process(self, process: ServerProcess, identity: ProcessId | None) -> None:
        deadline = (
            self._deadline if self._deadline is not None else SYSTEM.monotonic() + ORPHAN_GRACE
        )
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
                self._set_state(McpState.READY)
                self.log.info(
                    "MCP server {!r} ready (pid {}): {}",
                    self.name,
                    process.pid,
                    ", ".join(tool.name for tool in self.tools) or "no tools",
                )
                await process.closed.wait()
                self._session = None
                self._set_state(McpState.BACKOFF)
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
        if self.state is McpState.DOWN:
            return error_outcome(
                f"the MCP server {self.name!r} is unavailable: it crashed "
                f"{self.policy.max_crashes} times within {self.policy.window:g} s"
            )
        until = SYSTEM.monotonic() + self.config.call_timeout
        session, process = self._session, self.process
        if session is None and await self.wait_ready(self.config.call_timeout):
            session, process = self._session, self.process
        if session is None or process is None:
            if self.state in (McpState.STARTING, McpState.BACKOFF):
                return error_outcome(
                    f"the MCP server {self.name!r} is restarting and was not ready within "
                    f"{self.config.call_timeout:g} s; try again later"
                )
            return error_outcome(
                f"the MCP server {self.name!r} is not running ({self.state.value})"
            )
        timeout = max(until - SYSTEM.monotonic(), 0.001)
        try:
            result = await session.call_tool(tool, arguments, read_timeout_seconds=timeout)
        except MCPError as exc:
            if exc.code == mcp_types.REQUEST_TIMEOUT:
                return error_outcome(
                    f"the MCP tool {tool!r} of server {self.name!r} did not answer within "
                    f"{self.config.call_timeout:g} s; it was cancelled and may or may not "
                    "have taken effect"
                )
            if exc.code == mcp_types.CONNECTION_CLOSED:
                return await self._lost(process)
            return error_outcome(f"the MCP server {self.name!r} refused the call: {exc.message}")
        except Exception as exc:  # an answer the SDK cannot parse or validate
            self.log.warning("MCP server {!r}: unreadable answer to {}: {!r}", self.name, tool, exc)
            return error_outcome(f"the MCP server {self.name!r} gave an unreadable answer: {exc}")
        return outcome_of(result)

    async def _lost(self, process: ServerProcess) -> ToolOutcome:
        if self._deadline is not None:
            return error_outcome(f"the MCP server {self.name!r} was stopped during the call")
        await process.wait_exit(ORPHAN_GRACE)
        how = (
            "closed the connection"
            if process.returncode is None
            else f"exited ({process.describe_exit()})"
        )
        return error_outcome(
            f"the MCP server {self.name!r} {how} during the call; it is being restarted"
        )


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
