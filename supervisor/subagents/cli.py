"""`turnkeeper subagents SESSION`: the subagents a session spawned, through the daemon's
API (`GET /v1/sessions/{id}/subagents`), so it shows what the caller's token may read.

`turnkeeper sessions show` reads the same tree from the database instead, for the
operator, with the daemon up or down.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import connect, emit_json, json_option, reports_errors, table, when
from supervisor.cli.session_commands import clip
from supervisor.core.vocabulary import SubagentStatus

if TYPE_CHECKING:
    from supervisor.cli.client import Client

HEADERS = ["ID", "STATUS", "DEPTH", "CREATED", "ENDED", "TITLE", "RESULT"]
TITLE_WIDTH = 30  # characters of a title (or task) in a row; the result gets the rest
RESULT_WIDTH = 20  # at least, however narrow the terminal
STATUS_COLOURS: dict[str, str] = {
    SubagentStatus.RUNNING: "green",
    SubagentStatus.FAILED: "red",
    SubagentStatus.WEDGED: "red",
    SubagentStatus.CANCELLED: "yellow",
    SubagentStatus.FINALIZED: "yellow",
}


def register(group: click.Group) -> None:
    """Add `subagents` to `group`."""
    group.add_command(subagents)


def list_subagents(client: Client, session_id: str) -> list[dict[str, Any]]:
    """The session's subagents, oldest first, as the API gives them."""
    # Through the client's plumbing: client.py is at the size that wants a split.
    found: list[dict[str, Any]] = client._json("GET", f"/v1/sessions/{session_id}/subagents")[
        "subagents"
    ]
    return found


@click.command("subagents")
@click.argument("session_id", metavar="SESSION")
@json_option
@click.pass_context
@reports_errors
def subagents(ctx: click.Context, session_id: str, as_json: bool) -> None:
    """List the subagents SESSION spawned, oldest first, through the daemon.

    \b
    A subagent is a child session one of SESSION's turns started for a task
    (the spawn_subagent tool); its result comes back to SESSION once it ends.
    STATUS is
      running    it has work or a turn in flight; no result yet
      completed  it answered; RESULT is the start of the answer
      failed     its turn failed, or could not be continued safely
      cancelled  SESSION was interrupted or closed
      finalized  it was interrupted too long ago to be resumed
      wedged     its turn failed every time it ran
    DEPTH is 1 for a child of a top session, 2 for a child of a child. Only
    SESSION's children are listed: run this on a child for its own. Needs read
    access to SESSION (its subagents inherit its ACL) and the running daemon
    (exit 3 without it). `turnkeeper sessions show` prints the whole tree from
    the database.
    """
    with connect(ctx) as client:
        children = list_subagents(client, session_id)
    if as_json:
        emit_json({"subagents": children})
    elif not children:
        click.echo(f"session {session_id} has no subagents")
    else:
        click.echo("\n".join(subagent_table(children, shutil.get_terminal_size((80, 24)).columns)))


def subagent_table(children: list[dict[str, Any]], columns: int) -> list[str]:
    """One row a subagent, coloured by status on a terminal; the result fills what is left
    of `columns` (at least RESULT_WIDTH)."""
    from supervisor.cli.store_commands import paint

    rows = [
        [
            c["id"],
            c["status"],
            str(c["depth"]),
            when(c["created_at"]),
            when(c["ended_at"]),
            clip(" ".join((c["title"] or c["task"]).split()), TITLE_WIDTH),
            "",
        ]
        for c in children
    ]
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS) - 1)]
    room = max(columns - sum(widths) - 2 * len(widths), RESULT_WIDTH)
    for row, child in zip(rows, children, strict=True):
        row[-1] = clip(" ".join((child["result"] or "-").split()), room)
    return paint(table(HEADERS, rows), "STATUS", lambda s: STATUS_COLOURS.get(s)).split("\n")
