"""`turnkeeper restart` and `turnkeeper restarts`: ask the daemon to restart itself in place,
and list the requests, through its API (`POST /v1/restart`, `GET /v1/restarts`).

A restart is a request the daemon admits and records first; it then starts no new work,
lets the turns and tasks in flight finish within the drain (`restart.drain_budget`, or the
request's own), still taking messages for the next boot, and re-executes itself (the same
pid). The boot after it settles the request: `restart` waits for that, riding out the
seconds when nothing listens, and says how it went.
"""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import (
    EX_FAILURE,
    colour,
    connect,
    daemon_pid,
    emit_json,
    fail,
    find_daemon,
    json_option,
    load,
    reports_errors,
    table,
    when,
)
from supervisor.cli.session_commands import clip
from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import RestartOutcome, RestartState

if TYPE_CHECKING:
    from supervisor.cli.client import Client

BARE = -1.0  # `--drain` without a value: restart.drain_budget, as without the option
MAX_DRAIN = 3600.0
POLL = 0.2  # seconds between looks while waiting for the daemon to come back
HEADERS = ["ID", "STATE", "OUTCOME", "BY", "SESSION", "REQUESTED", "SECONDS", "REASON"]
REASON_WIDTH = 20  # at least, however narrow the terminal
OUTCOME_COLOURS: dict[str, str] = {RestartOutcome.OK: "green", RestartOutcome.FAILED: "red"}


def register(group: click.Group) -> None:
    """Add `restart` and `restarts` to `group`."""
    group.add_command(restart)
    group.add_command(restarts)


# Through the client's plumbing, as `turnkeeper deliveries` does: client.py is full.
def request_restart(client: Client, reason: str, drain: float | None) -> dict[str, Any]:
    """Ask for a restart: `{"restart": REQUEST, "in_progress": bool}` as the API answers."""
    answer: dict[str, Any] = client._json(
        "POST", "/v1/restart", json={"reason": reason, "drain": drain}
    )
    return answer


def get_restart(client: Client, restart_id: str) -> dict[str, Any]:
    """One restart request, as the API gives it."""
    found: dict[str, Any] = client._json("GET", f"/v1/restarts/{restart_id}")
    return found


def list_restarts(client: Client, limit: int, every: bool) -> list[dict[str, Any]]:
    """Restart requests, newest first: this daemon's host's, or every host's."""
    params = {"limit": limit, "all": "true" if every else "false"}
    found: list[dict[str, Any]] = client._json("GET", "/v1/restarts", params=params)["restarts"]
    return found


class _Drain(click.FloatRange):
    """Seconds from 0 to MAX_DRAIN, or BARE (the option without a value)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == BARE:
            return BARE
        return super().convert(value, param, ctx)


@click.command("restart")
@click.option(
    "--drain",
    type=_Drain(0, MAX_DRAIN),
    is_flag=False,
    flag_value=BARE,
    default=None,
    metavar="[SECONDS]",
    help="Let turns and tasks in flight finish first, up to SECONDS; 0 cuts them at once"
    " (they are continued after the restart). Without it: restart.drain_budget.",
)
@click.option(
    "--reason",
    default="",
    metavar="TEXT",
    help="Why (at most 500 characters); kept with the request and shown by `turnkeeper restarts`.",
)
@click.option("--no-wait", is_flag=True, help="Only ask; do not wait for the daemon to come back.")
@click.option(
    "--timeout",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for the daemon to come back, after the request's drain.",
)
@json_option
@click.pass_context
@reports_errors
def restart(
    ctx: click.Context,
    drain: float | None,
    reason: str,
    no_wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Restart the daemon in place (admin token): the same process re-executes itself.

    \b
    No new turn, task or schedule fire starts from the first moment; the turns
    and tasks in flight finish within the drain (restart.drain_budget), while
    messages are still taken (202) and answered after the restart; then the
    daemon re-executes itself and starts again, its sessions, tasks and
    schedules carried over as after any restart. A request while one
    is in progress is answered with that one, and waited for. Requests closer
    together than restart.min_interval are refused (exit 1, saying when to
    try again); so is a restart whose configuration on disk does not load.
    Waits until the daemon is back and ready and the request is settled, then
    prints how it went and how long it took until the new boot was ready.
    Exits 0 if it went well, 1 if it failed or the wait timed out, 3 if the
    daemon is not running.
    """
    cfg = load(ctx)
    seconds = drain if drain is None or drain >= 0 else None
    with connect(ctx) as client:
        answer = request_restart(client, reason, seconds)
        asked_at = SYSTEM.monotonic()  # the request admitted: the restart's time runs from here
        asked, in_progress = answer["restart"], bool(answer["in_progress"])
        if not as_json:
            click.echo(_asked(asked, in_progress))
        if no_wait:
            if as_json:
                emit_json({"restart": asked, "in_progress": in_progress, "done": False})
            return
        # The drain is the request's own (the one in progress may have another): on top.
        drained = asked.get("drain")
        timeout += float(cfg.restart.drain_budget if drained is None else drained)
        deadline = SYSTEM.monotonic() + timeout
        if sys.stderr.isatty() and not as_json:
            click.echo(f"waiting for the restart (up to {timeout:g} s)", err=True)
        settled, status = _wait(client, asked, deadline, timeout)
        ready_after = SYSTEM.monotonic() - asked_at
    pid = _pid_now(ctx, status)
    same = None if pid is None else pid == settled["pid"]
    ok = settled["outcome"] == RestartOutcome.OK
    if as_json:
        emit_json(
            {
                "restart": settled,
                "in_progress": in_progress,
                "done": True,
                "pid": pid,
                "same_process": same,
                "ready_after": round(ready_after, 3),
            }
        )
    else:
        click.echo("\n".join(_report(settled, pid, ready_after)))
    if not ok:
        sys.exit(EX_FAILURE)


def _asked(info: dict[str, Any], in_progress: bool) -> str:
    """The first line: the request admitted, or the one in progress that answered it."""
    if not in_progress:
        return f"restart requested ({info['id']})"
    why = f": {info['reason']}" if info["reason"] else ""
    return f"a restart is already in progress ({info['id']}, asked by {info['requested_by']}{why})"


def _wait(
    client: Client, asked: dict[str, Any], deadline: float, timeout: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settled request and the daemon's status once it is back, ready, and the request
    is done; nothing listening, a stopping daemon or a broken connection is waited out."""
    from supervisor.cli.client import DaemonUnavailable

    restart_id = asked["id"]
    seen = "the daemon has not answered"
    while True:
        try:
            status = client.status()
            boot = status["boot"]
            if boot["ready"] and not boot["stopping"]:
                found = get_restart(client, restart_id)
                if found["state"] == RestartState.DONE and found["boot_after"] in (
                    None,
                    boot["id"],
                ):
                    return found, status
                seen = f"boot {boot['id']} is ready, the request still {found['state']}"
            else:
                seen = f"boot {boot['id']} is {'stopping' if boot['stopping'] else 'starting'}"
        except DaemonUnavailable as exc:
            seen = f"the daemon is unreachable: {exc.reason}"
        if SYSTEM.monotonic() > deadline:
            fail(
                f"restart {restart_id} has not finished after {timeout:g} s ({seen}); "
                "see `turnkeeper restarts` and the daemon's log"
            )
        SYSTEM.sleep_blocking(POLL)


def _pid_now(ctx: click.Context, status: dict[str, Any]) -> int | None:
    """The daemon's pid now: its host row of this boot in the status, else the holder of
    the lock of the state directory it was found in."""
    me, boot = status["host"]["id"], status["boot"]["id"]
    for host in status.get("hosts") or []:
        if host["id"] == me and host["boot"] == boot:
            return int(host["pid"])
    found = find_daemon(ctx).running
    return None if found is None else daemon_pid(found.state_dir)


def _report(info: dict[str, Any], pid: int | None, ready_after: float) -> list[str]:
    """How the restart went: boots, pid, the time until the new boot was ready, outcome and
    detail, version and configuration.

    The time is the one an operator waits: from the request admitted until this command
    saw the new boot ready (its workers and their MCP servers up), within a look (POLL).
    The request's own `seconds`, from the stop to its settlement by the next boot, which
    settles it before its workers start, is given beside it."""
    ok = info["outcome"] == RestartOutcome.OK
    took = "?" if info["seconds"] is None else f"{info['seconds']:.1f}"
    if info["boot_after"] == info["boot"]:  # refused before it began: the same boot runs
        first = f"not restarted: boot {info['boot']} still runs"
        if pid is not None:
            first += f" (pid {pid})"
    else:
        done = "restarted" if ok else "the restart failed"
        first = (
            f"{done}, ready {ready_after:.1f} s after the request (stopped and started in "
            f"{took} s): boot {info['boot']} -> {info['boot_after']}"
        )
        if pid is not None:
            kind = (
                "the same process: re-executed in place" if pid == info["pid"] else "a new process"
            )
            first += f", pid {pid} ({kind})"
    outcome = colour(str(info["outcome"]), OUTCOME_COLOURS.get(info["outcome"], "yellow"))
    detail = f" ({info['detail']})" if info["detail"] else ""
    return [
        first,
        f"outcome: {outcome}{detail}",
        f"version {info['version_before']} -> {info['version_after']}, "
        f"configuration {info['config_before']} -> {info['config_after']}",
    ]


@click.command("restarts")
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Of every host on the database, not only this daemon's (adds a HOST column).",
)
@click.option(
    "--limit",
    default=20,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="At most this many, the newest.",
)
@json_option
@click.pass_context
@reports_errors
def restarts(ctx: click.Context, every: bool, limit: int, as_json: bool) -> None:
    """List restart requests, newest first (admin token).

    \b
    STATE is pending (admitted, not yet begun), restarting (the daemon is
    stopping for it) or done; OUTCOME ok or failed once done; BY the
    principal that asked (agent: a session's turn, SESSION); SECONDS from the
    start of the stop to the settlement by the next boot.
    """
    with connect(ctx) as client:
        found = list_restarts(client, limit, every)
    if as_json:
        emit_json({"restarts": found})
    elif not found:
        click.echo("no restart requests" + ("" if every else " of this host"))
    else:
        columns = shutil.get_terminal_size((80, 24)).columns
        click.echo("\n".join(restart_table(found, columns, hosts=every)))


def restart_table(found: list[dict[str, Any]], columns: int, *, hosts: bool = False) -> list[str]:
    """One row a request, the outcome coloured on a terminal; the reason fills what is left
    of `columns` (at least REASON_WIDTH). `hosts` adds each request's host."""
    from supervisor.cli.store_commands import paint

    headers = [*HEADERS[:-1], "HOST", HEADERS[-1]] if hosts else HEADERS
    rows = [
        [
            r["id"],
            r["state"],
            r["outcome"] or "-",
            r["requested_by"],
            r["session"] or "-",
            when(r["requested_at"]),
            "-" if r["seconds"] is None else f"{r['seconds']:.1f}",
            *([r["host"]] if hosts else []),
            "",
        ]
        for r in found
    ]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers) - 1)]
    room = max(columns - sum(widths) - 2 * len(widths), REASON_WIDTH)
    for row, r in zip(rows, found, strict=True):
        row[-1] = clip(" ".join(str(r["reason"]).split()) or "-", room)
    return paint(table(headers, rows), "OUTCOME", lambda s: OUTCOME_COLOURS.get(s)).split("\n")
