"""The stdio transport to one MCP server process, owned by turnkeeper.

The server runs in its own process group with PR_SET_PDEATHSIG (it dies with the worker),
started by `workers.mcp_launch` (perhaps before the SDK was imported: `attach` takes such a
process over). Its stdin, stdout and stderr are pipes that launch creates and this module
closes itself, so that a descendant that inherited them cannot keep the transport open
after the server is gone.
JSON-RPC is framed as one message per line; stdout lines go to the `ClientSession` through
an anyio memory stream, the session's messages go to stdin, and stderr lines go to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal

import anyio
import mcp_types
import psutil
from loguru import logger
from mcp.shared.message import SessionMessage

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM
from workers.mcp_launch import Launched

LINE_LIMIT = 32 * 1024 * 1024
"""Bytes; a longer stdout line is a broken server, and the connection is closed."""
DRAIN_BUDGET = 0.2
"""Seconds the stdout reader may go on after the server exited (its last answers)."""
REAP_BUDGET = 1.0
"""Seconds `terminate` waits after SIGKILL before it gives up on a process."""
POLL = 0.02


def _group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # kill(0) also succeeds for zombies, which an init that does not reap leaves around.
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


class ServerProcess:
    """One running MCP server: its process group, its pipes and the session's streams.

    `incoming` and `outgoing` are the streams to hand to `ClientSession`. `closed` is set
    when the connection ended: the server exited, or closed its stdout. `terminate` stops
    the whole group and releases everything; call it exactly once, always.
    """

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        stdin: asyncio.WriteTransport,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
        pipes: list[asyncio.BaseTransport],
    ) -> None:
        self.name = name
        self.pid = proc.pid
        self.pgid = proc.pid
        self.returncode: int | None = None
        self.closed = asyncio.Event()
        self.log = logger.bind(subsystem="mcp", server=name)
        self._proc = proc
        self._stdin = stdin
        self._pipes = pipes
        self._exited = asyncio.Event()
        self._in_send, self.incoming = anyio.create_memory_object_stream[
            SessionMessage | Exception
        ](0)
        self.outgoing, self._out_receive = anyio.create_memory_object_stream[SessionMessage](0)
        self._stdout_task = spawn(self._read_stdout(stdout), name="mcp-stdout")
        self._tasks = [
            self._stdout_task,
            spawn(self._read_stderr(stderr), name="mcp-stderr"),
            spawn(self._write_stdin(), name="mcp-stdin"),
            spawn(self._watch(), name="mcp-watch"),
        ]

    @classmethod
    async def attach(cls, name: str, launched: Launched) -> ServerProcess:
        """Take over a process `launch` started: its pipes go to this event loop.

        Raises OSError if they cannot, after killing the process group.
        """
        loop = asyncio.get_running_loop()
        readers = []
        pipes: list[asyncio.BaseTransport] = []
        try:
            for pipe in (launched.stdout, launched.stderr):
                reader = asyncio.StreamReader(limit=LINE_LIMIT)
                protocol = functools.partial(asyncio.StreamReaderProtocol, reader)
                transport, _ = await loop.connect_read_pipe(protocol, pipe)
                readers.append(reader)
                pipes.append(transport)
            stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, launched.stdin)
        except BaseException:
            for opened in pipes:
                opened.close()
            launched.discard()
            raise
        pipes.append(stdin)
        return cls(name, launched.proc, stdin, readers[0], readers[1], pipes)

    async def _read_stdout(self, stdout: asyncio.StreamReader) -> None:
        try:
            while line := await stdout.readline():
                if not line.strip():
                    continue
                item: SessionMessage | Exception
                try:
                    item = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line))
                except ValueError as exc:
                    self.log.warning(
                        "{}[{}]: not a JSON-RPC message on stdout: {!r}",
                        self.name,
                        self.pid,
                        line[:200],
                    )
                    item = exc
                await self._in_send.send(item)
        except ValueError:  # the StreamReader's limit
            self.log.error("{}[{}]: stdout line over {} bytes", self.name, self.pid, LINE_LIMIT)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
            pass
        finally:
            self._in_send.close()  # the session sees the end of the connection
            self.closed.set()

    async def _read_stderr(self, stderr: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await stderr.readline()
            except ValueError:  # over LINE_LIMIT: dropped; a server blocked on stderr would hang
                continue
            except ConnectionError:
                return
            if not line:
                return
            if text := line.decode("utf-8", "replace").rstrip():
                self.log.info("{}[{}]: {}", self.name, self.pid, text)

    async def _write_stdin(self) -> None:
        async for message in self._out_receive:
            if self._stdin.is_closing():
                continue  # the session learns of the end from stdout or the exit
            data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
            self._stdin.write(data.encode() + b"\n")

    async def _watch(self) -> None:
        self.returncode = await self._proc.wait()
        self._exited.set()
        # A descendant holding stdout open must not keep the connection up.
        await asyncio.wait([self._stdout_task], timeout=DRAIN_BUDGET)
        self._stdout_task.cancel()

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit code, waiting up to `timeout` seconds; None if it is still running."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._exited.wait(), timeout)
        return self.returncode

    def _signal_group(self, sig: int) -> None:
        # Once the leader is reaped, an empty group's id may be reused: only signal members.
        if self.returncode is not None and not _group_alive(self.pgid):
            return
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            self.log.warning("{}[{}]: cannot signal its group: {}", self.name, self.pid, exc)

    async def _gone_by(self, deadline: float) -> bool:
        while not (self._exited.is_set() and not _group_alive(self.pgid)):
            if SYSTEM.monotonic() >= deadline:
                return False
            await SYSTEM.sleep(POLL)
        return True

    async def terminate(self, deadline: float) -> None:
        """SIGTERM the process group; SIGKILL what is left at `deadline` (monotonic).

        Then waits up to `REAP_BUDGET` for the server to be reaped, and closes the pipes and
        streams. Descendants that left the group (setsid) are out of reach here.
        """
        self._signal_group(signal.SIGTERM)
        self._signal_group(signal.SIGCONT)  # a stopped process acts on SIGTERM only once woken
        if not await self._gone_by(deadline):
            self.log.warning(
                "{}[{}]: still running at the deadline; SIGKILL to its group", self.name, self.pid
            )
            self._signal_group(signal.SIGKILL)
            if not await self._gone_by(SYSTEM.monotonic() + REAP_BUDGET):
                self.log.error("{}[{}]: survived SIGKILL", self.name, self.pid)
        # Its last stderr lines (a traceback, say) are worth the wait; pipes held open by
        # an escaped descendant are not.
        await asyncio.wait(self._tasks[:2], timeout=DRAIN_BUDGET)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for pipe in self._pipes:
            pipe.close()
        for stream in (self._in_send, self.incoming, self.outgoing, self._out_receive):
            stream.close()
        self.closed.set()

    def describe_exit(self) -> str:
        """How the server ended, for messages: "exit code 3", "exit code -9, SIGKILL"."""
        code = self.returncode
        if code is None:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"exit code {code}, {signal.Signals(-code).name}"
        return f"exit code {code}"
