"""`turnkeeper reload`: the daemon reads its configuration again and applies it
(`POST /v1/reload`, as SIGHUP does), and this prints what changed:

    pool.workers: 2 -> 3
    mcp.servers.files.command: ["npx", "a"] -> ["npx", "b"]
    needs a restart: http.listen (left as it was)
    configuration 95311db4df12 -> 1a2b3c4d5e6f
    workers replaced

A configuration a start would refuse is the start's one line and exit 78, and the daemon
goes on with the one in force. The daemon is found by its lock and reached at
`http.listen`; if the file names another address now (a change that needs a restart),
at the address the daemon listens on.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import (
    config_error,
    daemon_pid,
    emit_json,
    fail,
    json_option,
    load,
    not_running,
    reports_errors,
)
from supervisor.contract.config import Config, resolve_paths

if TYPE_CHECKING:
    from supervisor.cli.client import Client

CONTROL_SOCKET = "control.sock"  # the workers' socket in the runtime directory: not the API
MARGIN = 5.0  # seconds the answer may take beyond the reload's --timeout


def register(group: click.Group) -> None:
    """Add `reload` to `group`."""
    group.add_command(reload)


@click.command("reload")
@click.option(
    "--timeout",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait until the new configuration is in force.",
)
@click.option(
    "--workers",
    "all_workers",
    is_flag=True,
    help="Replace every worker even if no key they read changed (an MCP server that was "
    "down and is fixed, agent code upgraded in place).",
)
@click.option(
    "--no-wait",
    is_flag=True,
    help="Return once the configuration is applied; slots and workers change in the background.",
)
@json_option
@click.pass_context
@reports_errors
def reload(
    ctx: click.Context, timeout: float, all_workers: bool, no_wait: bool, as_json: bool
) -> None:
    """Read the configuration again and apply it (SIGHUP does the same).

    \b
    What may change live is applied (pool size and spares, recovery and
    breaker, timeouts, MCP servers, agents, tokens file, log level, delivery
    targets, schedules, tasks); workers are replaced by a rolling restart,
    no turn lost, when a key they read changed (or always, with --workers).
    Keys that need a restart
    (daemon.*, store.*, http.*, ...) are named and left as they were.
    Waits until the new configuration is in force and prints each change,
    the configuration's version before and after, and whether the workers
    were replaced. A configuration a start would refuse changes nothing:
    its one line and exit 78. Exit 3 if the daemon is not running, 1 past
    --timeout (the reload goes on).
    """
    cfg = load(ctx)  # a file that does not load: the start's one line, exit 78
    paths = resolve_paths(cfg)
    pid = daemon_pid(paths)
    if pid is None:
        not_running("the daemon is not running (no process holds its lock)")
    result = request_reload(cfg, pid, wait=not no_wait, workers=all_workers, timeout=timeout)
    if as_json:
        emit_json(result)
    if not result["ok"]:
        config_error(str(result["error"]))
    if not as_json:
        click.echo("\n".join(result_lines(result, waited=not no_wait)))


def request_reload(
    cfg: Config, pid: int, *, wait: bool, workers: bool, timeout: float
) -> dict[str, Any]:
    """POST /v1/reload to the daemon `pid`; the result, also for a refused configuration."""
    from supervisor.cli.client import Client, DaemonNotRunning, find_token

    token, source = find_token(cfg)
    try:
        with Client(cfg.http.listen, token, source) as client:
            return _post(client, {"wait": wait, "workers": workers}, timeout)
    except DaemonNotRunning:
        # http.listen changed in the file, perhaps: the daemon listens where it started.
        for address in listening(pid, resolve_paths(cfg).runtime_dir):
            if address != cfg.http.listen:
                with Client(address, token, source) as client:
                    return _post(client, {"wait": wait, "workers": workers}, timeout)
        raise


def _post(client: Client, body: dict[str, bool], timeout: float) -> dict[str, Any]:
    import time

    import httpx

    from supervisor.cli.client import TIMEOUT, ClientTimeout, _transport_errors

    deadline = time.monotonic() + timeout + MARGIN
    try:
        with _transport_errors(client.address, deadline):
            response = client._http.post(
                "/v1/reload",
                json=body,
                timeout=httpx.Timeout(TIMEOUT, read=timeout + MARGIN),
            )
    except ClientTimeout:
        fail(f"the reload has not finished after {timeout:g} s; it goes on in the daemon")
    if response.status_code == 422:
        refused = response.json()
        if isinstance(refused, dict) and isinstance(refused.get("result"), dict):
            found: dict[str, Any] = refused["result"]
            return found
    if response.status_code >= 400:
        raise client._api_error(response)
    result: dict[str, Any] = response.json()
    return result


def listening(pid: int, runtime_dir: Path) -> list[str]:
    """The API addresses the process `pid` listens on, as `http.listen` writes them."""
    import psutil

    try:
        connections = psutil.Process(pid).net_connections(kind="all")
    except psutil.Error:
        return []
    found: list[str] = []
    for c in connections:
        if c.family == socket.AF_UNIX and isinstance(c.laddr, str) and c.laddr:
            if Path(c.laddr) != runtime_dir / CONTROL_SOCKET:
                found.append(f"unix:{c.laddr}")
        elif c.status == psutil.CONN_LISTEN and c.laddr:
            host, port = c.laddr[0], c.laddr[1]
            found.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return list(dict.fromkeys(found))


def result_lines(result: dict[str, Any], *, waited: bool = True) -> list[str]:
    """What a reload did, for a person: each change, each key left for a restart, the
    version, the workers."""
    lines = [
        f"{c['key']}: {shown(c['before'])} -> {shown(c['after'])}"
        for c in result["changes"]
        if c["effect"] != "restart"
    ]
    lines += [f"needs a restart: {key} (left as it was)" for key in result["needs_restart"]]
    before, now = result["version_before"], result["version"]
    lines.append(
        f"configuration {before} -> {now}" if before != now else f"configuration {now} unchanged"
    )
    if not result["workers_replaced"]:
        lines.append("workers kept")
    else:
        lines.append("workers replaced" if waited else "workers being replaced")
    return lines


def shown(value: Any) -> str:
    """A configuration value as JSON; `(none)` for an entry that is not there."""
    return "(none)" if value is None else json.dumps(value, ensure_ascii=False)
