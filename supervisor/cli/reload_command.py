"""`turnkeeper reload`: the daemon reads its configuration again and applies it
(`POST /v1/reload`, as SIGHUP does), and this prints what changed:

    pool.workers: 2 -> 3
    mcp.servers.files.command: ["npx", "a"] -> ["npx", "b"]
    needs a restart: http.listen (left as it was)
    configuration 95311db4df12 -> 1a2b3c4d5e6f
    workers replaced

A configuration a start would refuse is the start's one line and exit 78, and the daemon
goes on with the one in force. A pool not yet as the configuration says (a new worker
that could not start stopped the rolling restart, or an MCP server of a worker the reload
started did not start: `not done: MCP servers did not start: NAME (worker W: backoff)`)
is exit 1, after what changed.

The daemon is found as every command finds it (`supervisor.cli.discovery`); if the file
names another directory now (a change that needs a restart), as the process of this user
that holds a daemon's lock elsewhere and says it runs from this file. The admin token goes only to
an address that process listens on: `http.listen` if it is one of them (a changed
address, which needs a restart, is not), else the one it listens on.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli import discovery
from supervisor.cli.common import (
    EX_UNKNOWN,
    config_error,
    emit_json,
    fail,
    json_option,
    load,
    not_running,
    reports_errors,
)
from supervisor.contract.config import Config, parse_listen

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
    Keys that need a restart (daemon.*, store.*, http.*, ...) are named and
    left as they were.
    Waits until the new configuration is in force and the new workers' MCP
    servers are up, and prints each change, the configuration's version
    before and after, and whether the workers were replaced. A configuration
    a start would refuse changes nothing: its one line and exit 78. Exit 3
    if the daemon is not running, 1 past --timeout (the reload goes on),
    when a new worker could not start (`not done: ...`: the workers not yet
    replaced go on) or when an MCP server of a new worker did not start
    (`not done: MCP servers did not start: ...`).
    """
    cfg = load(ctx)  # a file that does not load: the start's one line, exit 78
    found = locate(cfg)
    if found is None:
        not_running("the daemon is not running (no process holds its lock)")
    pid, reach = found
    result = request_reload(reach, pid, wait=not no_wait, workers=all_workers, timeout=timeout)
    if as_json:
        emit_json(result)
    if not result["ok"]:
        config_error(str(result["error"]))
    if not as_json:
        click.echo("\n".join(result_lines(result, waited=not no_wait)))
    if result.get("incomplete"):
        fail(str(result["incomplete"]))


def locate(cfg: Config) -> tuple[int, Config] | None:
    """The daemon `cfg`'s file is for: its pid, and `cfg` with the state directory it
    holds (where its admin token is) and the address it published. None: none runs.

    Found as every command finds it (`supervisor.cli.discovery`); a place this user may
    not read is exit 4, naming it."""
    found = discovery.find(cfg)
    if found.running is not None:
        running = found.running
        daemon = cfg.daemon.model_copy(update={"state_dir": str(running.state_dir)})
        http = cfg.http.model_copy(update={"listen": running.listen})
        return running.pid, cfg.model_copy(update={"daemon": daemon, "http": http})
    if cfg.source is not None:
        for pid, state_dir in lock_holders():
            moved = cfg.model_copy(
                update={"daemon": cfg.daemon.model_copy(update={"state_dir": str(state_dir)})}
            )
            if runs_from(moved, pid, cfg.source):
                return pid, moved
    if found.unknown is not None:
        fail(
            f"cannot tell whether the daemon runs: {found.unknown}: run as the service user",
            EX_UNKNOWN,
        )
    return None


def lock_holders() -> list[tuple[int, Path]]:
    """The daemons of this user (any state directory): each one's pid and the state
    directory whose lock it holds."""
    import os

    import psutil

    from supervisor import locks

    found = []
    for proc in psutil.process_iter(["uids", "cmdline"]):
        uids, cmdline = proc.info.get("uids"), proc.info.get("cmdline") or []
        if uids is None or uids.real != os.getuid() or not cmdline:
            continue
        if not " ".join(cmdline).startswith("turnkeeper: supervisor"):
            continue
        try:
            paths = [Path(f.path) for f in proc.open_files()]
        except psutil.Error:
            continue
        for path in paths:
            if path.name == locks.LEADER_LOCK and locks.holder(path) == proc.pid:
                found.append((proc.pid, path.parent))
    return found


def runs_from(cfg: Config, pid: int, source: Path) -> bool:
    """Whether the daemon `pid` (reached as `cfg` says) runs from the file `source`."""
    import psutil

    from supervisor.cli.client import Client, ClientError, find_token

    try:
        token, where = find_token(cfg)
        with Client(address(cfg, pid), token, where) as client:
            shown = client.status()["config"]["source"]
        cwd = Path(psutil.Process(pid).cwd())
    except (ClientError, psutil.Error, KeyError, TypeError):
        return False
    return shown is not None and (cwd / shown).resolve() == source.absolute().resolve()


def request_reload(
    cfg: Config, pid: int, *, wait: bool, workers: bool, timeout: float
) -> dict[str, Any]:
    """POST /v1/reload to the daemon `pid`; the result, also for a refused configuration."""
    from supervisor.cli.client import Client, find_token

    token, source = find_token(cfg)
    with Client(address(cfg, pid), token, source) as client:
        return _post(client, {"wait": wait, "workers": workers}, timeout)


def address(cfg: Config, pid: int) -> str:
    """Where to reach the daemon `pid`: `http.listen` if it listens there (the file may
    name another address now, a change that needs a restart), else where it does listen.
    Raises ClientError if it listens nowhere it can be seen to."""
    from supervisor.cli.client import ClientError

    found = listening(pid)
    if found is None:  # another user's process: as every command, at http.listen
        return cfg.http.listen
    if not found:
        raise ClientError(f"the daemon (pid {pid}) listens on no address of its API")
    wanted = parse_listen(cfg.http.listen)
    return next((a for a in found if parse_listen(a) == wanted), found[0])


def _post(client: Client, body: dict[str, bool], timeout: float) -> dict[str, Any]:
    import httpx

    from supervisor.cli.client import TIMEOUT, ClientTimeout, _transport_errors
    from supervisor.contract.clock import SYSTEM

    deadline = SYSTEM.monotonic() + timeout + MARGIN
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


def listening(pid: int) -> list[str] | None:
    """The API addresses the process `pid` listens on, as `http.listen` writes them; None
    if they cannot be seen (another user's process)."""
    import psutil

    try:
        connections = psutil.Process(pid).net_connections(kind="all")
    except psutil.AccessDenied:
        return None
    except psutil.Error:
        return []
    found: list[str] = []
    for c in connections:
        if c.family == socket.AF_UNIX and isinstance(c.laddr, str) and c.laddr[:1] == "/":
            if Path(c.laddr).name != CONTROL_SOCKET:  # the workers' (in any runtime dir)
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
    for principal in result.get("revoked", []):
        lines.append(
            f"revoked: {principal} (requests in flight refused, schedules paused, "
            "running tasks cancelled)"
        )
    before, now = result["version_before"], result["version"]
    lines.append(
        f"configuration {before} -> {now}" if before != now else f"configuration {now} unchanged"
    )
    incomplete = result.get("incomplete")
    if not incomplete or result.get("mcp_not_started"):  # the pool was changed as asked
        if not result["workers_replaced"]:
            lines.append("workers kept")
        else:
            lines.append("workers replaced" if waited else "workers being replaced")
    if incomplete:
        lines.append(f"not done: {incomplete}")
    return lines


def shown(value: Any) -> str:
    """A configuration value as JSON; `(none)` for an entry that is not there."""
    return "(none)" if value is None else json.dumps(value, ensure_ascii=False)
