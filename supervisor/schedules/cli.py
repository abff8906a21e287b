"""`turnkeeper schedules list|add|remove|pause|resume`: schedules, through the daemon's API
(`/v1/schedules`), so a caller sees and changes what its token may.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import connect, emit_json, json_option, reports_errors, table, when
from supervisor.cli.session_commands import clip
from supervisor.core.vocabulary import Misfire

if TYPE_CHECKING:
    from supervisor.cli.client import Client

HEADERS = ["ID", "CRON", "TIMEZONE", "MISFIRE", "SESSION", "NEXT", "LAST", "TEXT"]
TEXT_WIDTH = 20  # at least, however narrow the terminal
NEW_EACH_RUN = "(new each run)"


def register(group: click.Group) -> None:
    """Add `schedules` to `group`."""
    group.add_command(schedules)


# Through the client's plumbing: client.py is at the size that wants a split.
def list_schedules(client: Client, limit: int = 1000) -> list[dict[str, Any]]:
    """The schedules the caller may read, oldest first, as the API gives them."""
    found: list[dict[str, Any]] = client._json("GET", "/v1/schedules", params={"limit": limit})[
        "schedules"
    ]
    return found


def add_schedule(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    """Make a schedule; the API's answer (the schedule and its next time)."""
    made: dict[str, Any] = client._json("POST", "/v1/schedules", json=body)
    return made


def remove_schedule(client: Client, schedule_id: str) -> dict[str, Any]:
    """Delete a schedule."""
    gone: dict[str, Any] = client._json("DELETE", f"/v1/schedules/{schedule_id}")
    return gone


def set_held(client: Client, schedule_id: str, held: bool) -> dict[str, Any]:
    """Pause (hold) or resume a schedule; the API's answer (the schedule)."""
    verb = "pause" if held else "resume"
    changed: dict[str, Any] = client._json("POST", f"/v1/schedules/{schedule_id}/{verb}")
    return changed


@click.group("schedules")
def schedules() -> None:
    """Messages injected on a cron schedule, through the daemon.

    \b
    A schedule injects its TEXT into a session at every time of its cron
    expression: 5 fields (minute hour day-of-month month day-of-week), or 6
    with seconds first (`30 */5 * * * *` is 30 s past every fifth minute). Each time fires
    once, across restarts and daemons. Without --session each run gets a new
    session of kind `scheduled`, which the schedule's owner can read.
    """


@schedules.command("list")
@json_option
@click.pass_context
@reports_errors
def list_command(ctx: click.Context, as_json: bool) -> None:
    """List the schedules the caller may read, oldest first.

    NEXT is the next scheduled time (or `held`: paused by `schedules pause`;
    `paused`: its owner's token was revoked; `ended`: its session was closed);
    LAST the latest one decided and its outcome (fired, caught_up after a
    restart, skipped).
    """
    with connect(ctx) as client:
        found = list_schedules(client)
    if as_json:
        emit_json({"schedules": found})
    elif not found:
        click.echo("no schedules")
    else:
        click.echo("\n".join(schedule_table(found, shutil.get_terminal_size((80, 24)).columns)))


@schedules.command("add")
@click.argument("cron")
@click.argument("text")
@click.option(
    "--session",
    "session_id",
    default=None,
    metavar="SESSION",
    help=("The session each run goes to (write access needed); default: a new session each run."),
)
@click.option("--timezone", default="UTC", show_default=True, help="An IANA time zone.")
@click.option(
    "--misfire",
    type=click.Choice([m.value for m in Misfire]),
    default=Misfire.RUN_ONCE.value,
    show_default=True,
    help="Runs missed while no daemon ran: run_once runs the newest once (within "
    "schedules.misfire_grace), skip runs none.",
)
@json_option
@click.pass_context
@reports_errors
def add_command(
    ctx: click.Context,
    cron: str,
    text: str,
    session_id: str | None,
    timezone: str,
    misfire: str,
    as_json: bool,
) -> None:
    """Inject TEXT at every time of CRON (quote it: `"*/5 * * * *"`)."""
    body = {"cron": cron, "text": text, "session": session_id, "timezone": timezone}
    with connect(ctx) as client:
        made = add_schedule(client, {**body, "misfire": misfire})
    if as_json:
        emit_json(made)
        return
    where = f"session {made['session']}" if made["session"] else "a new session each run"
    click.echo(f"schedule {made['id']}: {made['cron']} ({made['timezone']}) into {where}")
    click.echo(f"next run: {when(made['next_fire_at'])}")


@schedules.command("remove")
@click.argument("schedule_id", metavar="ID")
@json_option
@click.pass_context
@reports_errors
def remove_command(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """Delete schedule ID: it fires no more."""
    with connect(ctx) as client:
        gone = remove_schedule(client, schedule_id)
    if as_json:
        emit_json(gone)
    else:
        click.echo(f"schedule {schedule_id} removed")


@schedules.command("pause")
@click.argument("schedule_id", metavar="ID")
@json_option
@click.pass_context
@reports_errors
def pause_command(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """Hold schedule ID: it does not fire until `schedules resume ID`."""
    _hold(ctx, schedule_id, as_json, held=True)


@schedules.command("resume")
@click.argument("schedule_id", metavar="ID")
@json_option
@click.pass_context
@reports_errors
def resume_command(ctx: click.Context, schedule_id: str, as_json: bool) -> None:
    """Let held schedule ID fire again, from now on (no missed time is caught up)."""
    _hold(ctx, schedule_id, as_json, held=False)


def _hold(ctx: click.Context, schedule_id: str, as_json: bool, held: bool) -> None:
    with connect(ctx) as client:
        changed = set_held(client, schedule_id, held)
    if as_json:
        emit_json(changed)
    elif held:
        click.echo(f"schedule {schedule_id} held: it does not fire until resumed")
    else:
        click.echo(f"schedule {schedule_id} resumed; next run: {when(changed['next_fire_at'])}")


def schedule_table(found: list[dict[str, Any]], columns: int) -> list[str]:
    """One row a schedule; the text fills what is left of `columns` (at least TEXT_WIDTH)."""
    rows = []
    for s in found:
        last = s["last_fire"]
        rows.append(
            [
                s["id"],
                s["cron"],
                s["timezone"],
                s["misfire"],
                s["session"] or NEW_EACH_RUN,
                when(s["next_fire_at"]) if s.get("status", "active") == "active" else s["status"],
                "-" if last is None else f"{when(last['scheduled_for'])} {last['outcome']}",
                "",
            ]
        )
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS) - 1)]
    room = max(columns - sum(widths) - 2 * len(widths), TEXT_WIDTH)
    for row, s in zip(rows, found, strict=True):
        row[-1] = clip(" ".join(s["text"].split()), room)
    return table(HEADERS, rows).split("\n")
