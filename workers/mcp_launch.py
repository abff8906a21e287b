"""Starting MCP server processes, before the worker has imported the MCP SDK.

A worker starts its servers' processes first thing (`launch_all`), so that each server's
own start (an interpreter, its imports, its SDK) runs while the worker imports its own
modules, the SDK among them, and opens its database. `workers.mcp_transport` then connects
a `ClientSession` to the running process; a server that dies later is started again by
`launch` alone. Nothing here imports the SDK.

A process is started in its own process group with PR_SET_PDEATHSIG (it dies with the
worker, even one that never got as far as connecting to it), with the soft file
descriptor limit the daemon started with (`supervisor.contract.fdlimit`: a server may use
select()), with the minimal environment of `supervisor.contract.mcp_env.child_environment`,
and with three pipes whose far ends only the child holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from supervisor.contract import fdlimit
from supervisor.contract.config import McpServer
from supervisor.contract.mcp_env import child_environment
from supervisor.contract.reaper import new_group_with_pdeathsig


@dataclass(eq=False)
class Launched:
    """A started server process and this side's ends of its stdin, stdout and stderr."""

    proc: asyncio.subprocess.Process
    stdin: IO[bytes]
    stdout: IO[bytes]
    stderr: IO[bytes]

    def discard(self) -> None:
        """Kill the process group and close the pipes: it will not be connected to."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pipe in (self.stdin, self.stdout, self.stderr):
            pipe.close()


def _in_the_child() -> None:
    """Between fork and exec: a group of its own, death with the worker, the soft file
    descriptor limit the daemon started with."""
    new_group_with_pdeathsig()
    fdlimit.give_back()


async def launch(command: Sequence[str], env: Mapping[str, str], cwd: str | None) -> Launched:
    """Start `command` in a new process group; raises OSError if it cannot be run."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    stdin = os.fdopen(in_w, "wb", buffering=0)
    stdout = os.fdopen(out_r, "rb", buffering=0)
    stderr = os.fdopen(err_r, "rb", buffering=0)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=in_r,
            stdout=out_w,
            stderr=err_w,
            cwd=cwd or None,
            env=dict(env),
            preexec_fn=_in_the_child,
        )
    except BaseException:
        for pipe in (stdin, stdout, stderr):
            pipe.close()
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    return Launched(proc, stdin, stdout, stderr)


async def launch_server(server: McpServer) -> Launched:
    """Start one configured server's process, with its minimal environment."""
    return await launch(server.command, child_environment(server.env), server.cwd)


async def launch_all(servers: Sequence[McpServer]) -> dict[str, Launched | OSError]:
    """Start every server's process, by name; a command that cannot be run is its error.

    Only the processes: the MCP handshakes come later, all at once (`workers.mcp`).
    """
    launched: dict[str, Launched | OSError] = {}
    for server in servers:
        try:
            launched[server.name] = await launch_server(server)
        except OSError as exc:
            launched[server.name] = exc
    return launched
