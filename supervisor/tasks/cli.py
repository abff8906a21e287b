"""`turnkeeper tasks [ID]`: background tasks through the daemon's API, so it shows what the
caller's token may read. Without ID, the live tasks (or those of `--status`) of every
session it may read (`GET /v1/tasks`); a session id lists the session's tasks
(`GET /v1/sessions/{id}/tasks`); a task id shows that task (`GET /v1/tasks/{id}`), and
with `--cancel` cancels it (`DELETE /v1/tasks/{id}`).
"""

from __future__ import annotations

import re
import shutil
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import connect, emit_json, json_option, reports_errors, table, when
from supervisor.cli.session_commands import clip
from supervisor.core.vocabulary import TaskStatus

if TYPE_CHECKING:
    from supervisor.cli.client import Client

SESSION_ID = re.compile(r"[0-9a-f]{32}")
TASK_ID = re.compile(r"t[0-9a-f]{32}")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but tab and newline
HEADERS = ["ID", "KIND", "STATUS", "CREATED", "ENDED", "EXIT", "ARGS"]
ARGS_WIDTH = 20  # at least, however narrow the terminal
STATUS_COLOURS: dict[str, str] = {
    TaskStatus.RUNNING: "green",
    TaskStatus.SUCCEEDED: "green",
    TaskStatus.FAILED: "red",
    TaskStatus.TIMED_OUT: "red",
    TaskStatus.LOST: "red",
    TaskStatus.CANCELLED: "yellow",
}


def register(group: click.Group) -> None:
    """Add `tasks` to `group`."""
    group.add_command(tasks)


def _request(client: Client, method: str, path: str) -> Any:
    # Through the client's plumbing, as `turnkeeper subagents` does: client.py is full.
    return client._json(method, path)


@click.command("tasks")
@click.argument("ident", metavar="[ID]", required=False)
@click.option("--cancel", is_flag=True, help="Cancel the task ID (write access to its session).")
@click.option(
    "--status",
    "statuses",
    default="pending,running",
    show_default=True,
    help="Without ID: the statuses to list, comma-separated, or `all`.",
)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 1000))
@json_option
@click.pass_context
@reports_errors
def tasks(
    ctx: click.Context,
    ident: str | None,
    cancel: bool,
    statuses: str,
    limit: int,
    as_json: bool,
) -> None:
    """List background tasks, or show (or cancel) one task.

    \b
    Without ID: the pending and running tasks (or those of --status) of every
    session the caller may read, newest first. ID is a session id (32 hex
    digits): its tasks, oldest first; or a task id ("t" and 32 hex digits):
    that task, with the link to its output.
    A task is a command of a kind the operator defined ([[tasks.kinds]]) that
    one of the session's turns started (the start_task tool); its outcome is
    told to the session once it ends. STATUS is
      pending    admitted; no runner has started it yet
      running    its command runs
      succeeded  it exited 0
      failed     it exited non-zero, was killed, or could not start
      timed_out  it ran past its kind's timeout and was stopped
      cancelled  --cancel (or DELETE /v1/tasks/ID) stopped it
      lost       its runner went away with no outcome (a restart)
    --cancel stops a running task (SIGTERM, then SIGKILL after tasks.kill_grace)
    or drops a pending one. Needs read access to the task's session (write to
    cancel) and the running daemon (exit 3 without it).
    """
    if ident is None:
        if cancel:
            raise click.BadParameter("--cancel takes a task id", param_hint="ID")
        _list_all(ctx, statuses, limit, as_json)
        return
    is_task = TASK_ID.fullmatch(ident) is not None
    if not is_task and SESSION_ID.fullmatch(ident) is None:
        raise click.BadParameter(
            "must be a session id (32 hex digits) or a task id ('t' and 32 hex digits)",
            param_hint="ID",
        )
    if cancel and not is_task:
        raise click.BadParameter(
            "--cancel takes a task id ('t' and 32 hex digits)", param_hint="ID"
        )
    with connect(ctx) as client:
        if not is_task:
            found: list[dict[str, Any]] = _request(client, "GET", f"/v1/sessions/{ident}/tasks")[
                "tasks"
            ]
        else:
            task: dict[str, Any] = _request(
                client, "DELETE" if cancel else "GET", f"/v1/tasks/{ident}"
            )
    if not is_task:
        if as_json:
            emit_json({"tasks": found})
        elif not found:
            click.echo(f"session {ident} has no tasks")
        else:
            click.echo("\n".join(task_table(found, shutil.get_terminal_size((80, 24)).columns)))
    elif as_json:
        emit_json(task)
    elif cancel:
        click.echo(cancelled(task))
    else:
        click.echo("\n".join(task_lines(task)))


def _list_all(ctx: click.Context, statuses: str, limit: int, as_json: bool) -> None:
    wanted = "" if statuses.strip() == "all" else statuses.replace(" ", "")
    known = {status.value for status in TaskStatus}
    for status in filter(None, wanted.split(",")):
        if status not in known:
            raise click.BadParameter(
                f"{status!r} is not a task status ({', '.join(sorted(known))}, or all)",
                param_hint="--status",
            )
    with connect(ctx) as client:
        found: list[dict[str, Any]] = client._json(
            "GET", "/v1/tasks", params={"status": wanted, "limit": limit}
        )["tasks"]
    if as_json:
        emit_json({"tasks": found})
    elif not found:
        click.echo("no tasks" if not wanted else f"no {wanted.replace(',', ' or ')} tasks")
    else:
        click.echo("\n".join(task_table(found, shutil.get_terminal_size((80, 24)).columns)))


def cancelled(task: dict[str, Any]) -> str:
    """What a cancel did, in one line."""
    status = task["status"]
    if status == TaskStatus.RUNNING:
        return f"task {task['id']}: asked to stop; its outcome will be `cancelled`"
    if status == TaskStatus.CANCELLED:
        return f"task {task['id']} cancelled"
    return f"task {task['id']} had already ended: {status}"


def task_table(found: list[dict[str, Any]], columns: int) -> list[str]:
    """One row a task, coloured by status on a terminal; the arguments fill what is left of
    `columns` (at least ARGS_WIDTH)."""
    from supervisor.cli.store_commands import paint

    rows = [
        [
            t["id"],
            t["kind"],
            t["status"],
            when(t["created_at"]),
            when(t["ended_at"]),
            "-" if t["exit_code"] is None else str(t["exit_code"]),
            "",
        ]
        for t in found
    ]
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS) - 1)]
    room = max(columns - sum(widths) - 2 * len(widths), ARGS_WIDTH)
    for row, task in zip(rows, found, strict=True):
        row[-1] = clip(_args(task["args"]) or "-", room)
    return paint(table(HEADERS, rows), "STATUS", lambda s: STATUS_COLOURS.get(s)).split("\n")


def task_lines(task: dict[str, Any]) -> list[str]:
    """One task, a field a line, then the end of its output once it ended."""
    status = task["status"]
    if task["attempt"] > 1:
        status += f" (attempt {task['attempt']})"
    if task["cancel_requested"] and task["status"] == TaskStatus.RUNNING:
        status += ", cancel requested"
    lines = [
        f"task      {task['id']}",
        f"session   {task['session']}",
        f"kind      {task['kind']}",
        f"args      {_args(task['args']) or '-'}",
        f"status    {status}",
        f"host      {task['host'] or '-'}",
        f"created   {when(task['created_at'])}   started {when(task['started_at'])}"
        f"   ended {when(task['ended_at'])}",
    ]
    if task["exit_code"] is not None or task["duration"] is not None:
        code = "-" if task["exit_code"] is None else task["exit_code"]
        took = "-" if task["duration"] is None else f"{task['duration']:.1f} s"
        lines.append(f"exit      {code}   after {took}")
    if task["reason"]:
        lines.append(f"reason    {' '.join(task['reason'].split())}")
    lines.append(f"output    {task['output_url']}")
    if task["output_tail"]:
        tail = CONTROL.sub("\ufffd", task["output_tail"].rstrip("\n"))  # no terminal escapes
        lines += ["", "the end of its output:", tail]
    return lines


def _args(args: dict[str, str]) -> str:
    return " ".join(f"{name}={' '.join(value.split())}" for name, value in sorted(args.items()))
