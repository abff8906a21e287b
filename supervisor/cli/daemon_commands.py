"""Commands that talk to the running daemon over its HTTP API: new, send, attach,
interrupt, status and grant.

`supervisor.cli.main` registers them with `register(main)`. The client is imported inside
the functions, so that httpx does not slow down every other command.

Exit codes (docs/reference/exit-codes.md): 0 success; 1 a failure (an API error, a turn that failed
or was interrupted under `send --wait`); 2 a usage error; 3 the daemon is not running
(none found, nothing listens where it was, or a stream without reconnection lost it); 4
this user cannot tell (it may not read the daemon's directories or its token).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli import hosts_command
from supervisor.cli.common import (
    EX_FAILURE,
    colour,
    connect,
    emit_json,
    fail,
    json_option,
    reports_errors,
    table,
    when,
)
from supervisor.contract.clock import SYSTEM
from supervisor.core.vocabulary import McpState, Permission, SessionKind, SlotState, TurnOutcome

if TYPE_CHECKING:
    from supervisor.cli.client import Client, Reconnect
    from supervisor.cli.live import Live

KINDS = [kind.value for kind in SessionKind]
PERMISSIONS = [*(permission.value for permission in Permission), "none"]
# The outcomes of a turn that `send --wait` calls a success (exit 0); any other exits 1.
ANSWERED = (TurnOutcome.COMPLETED, TurnOutcome.TRUNCATED)
STDIN = "-"  # TEXT that means: read the message from standard input
DELTA = "delta"  # the type of a turn's live output among the events (`client.DELTA`)


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    for command in (new, send, attach, interrupt, status, grant):
        group.add_command(command)


session_argument = click.argument("session_id", metavar="SESSION")


@click.command("new")
@click.option("--title", default="", help="A title to recognise the session by.")
@click.option("--kind", default="attached", show_default=True, type=click.Choice(KINDS))
@click.option(
    "--deliver-to",
    default=None,
    metavar="TARGET",
    help="Push its replies to this delivery target (a name of [[delivery.targets]]).",
)
@json_option
@click.pass_context
@reports_errors
def new(ctx: click.Context, title: str, kind: str, deliver_to: str | None, as_json: bool) -> None:
    """Create a session through the daemon; prints its id (--json: the whole session)."""
    with connect(ctx) as client:
        session = client.create_session(title, kind, deliver_to)
    if as_json:
        emit_json(session)
    else:
        click.echo(session["id"])


@click.command("send")
@session_argument
@click.argument("text")
@click.option(
    "--wait",
    is_flag=True,
    help="Print the reply of the turn that follows, across a restart of the daemon.",
)
@click.option("--key", default=None, help="Idempotency key: the same key is committed once.")
@click.option(
    "--no-stream",
    is_flag=True,
    help="With --wait: print only committed events, not the text as the model streams it.",
)
@click.option(
    "--timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for the reply, with --wait.",
)
@json_option
@click.pass_context
@reports_errors
def send(
    ctx: click.Context,
    session_id: str,
    text: str,
    wait: bool,
    key: str | None,
    no_stream: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """Send a user message TEXT (- reads it from standard input); it is committed before
    this returns. With --wait, exits 1 if the turn that follows fails or is interrupted;
    a restart of the daemon meanwhile is ridden out as `attach` does (said on stderr).

    With --wait the reply's text is printed as the model streams it (on a terminal), then
    the committed answer; --wait --json prints each delta as one JSON line, then the
    document on one line. --no-stream prints only what is committed."""
    message = read_stdin() if text == STDIN else text
    with connect(ctx) as client:
        seq = client.inject(session_id, message, key)
        if not as_json:
            click.echo(f"committed as seq {seq}", err=True)
        if not wait:
            if as_json:
                emit_json({"seq": seq})
            return
        deadline = SYSTEM.monotonic() + timeout
        reconnect = reconnecting(client.address, from_start=True)  # it was there just now
        live = streaming(as_json, no_stream)
        reply = wait_for_reply(
            client, session_id, seq, deadline, echo=not as_json, reconnect=reconnect, live=live
        )
    if reply is None:
        fail(f"no reply within {timeout:g} s")
    if as_json and live is not None:
        json_line({"seq": seq, **reply.document()})  # after delta lines: JSON Lines
    elif as_json:
        emit_json({"seq": seq, **reply.document()})
    if reply.outcome not in ANSWERED:
        ctx.exit(EX_FAILURE)


def streaming(as_json: bool, no_stream: bool) -> Live | JsonDeltas | None:
    """How a turn's live output is printed: as JSON lines (--json), as text on a
    terminal, or not at all (--no-stream; text piped elsewhere)."""
    from supervisor.cli.live import Live

    if no_stream:
        return None
    if as_json:
        return JsonDeltas()
    return Live() if sys.stdout.isatty() else None


class JsonDeltas:
    """--json's live output: each delta as one JSON line; committed events unchanged."""

    def delta(self, delta: dict[str, Any]) -> None:
        json_line(delta)

    def shown(self, kind: str, payload: dict[str, Any]) -> bool:
        return False


def json_line(data: dict[str, Any]) -> None:
    """One JSON object on one line (JSON Lines), keys sorted."""
    import json

    click.echo(json.dumps(data, sort_keys=True, ensure_ascii=False))


def read_stdin() -> str:
    """The message on standard input, without its final newlines; empty is a usage error."""
    text = sys.stdin.read().rstrip("\r\n")
    if not text.strip():
        raise click.BadParameter("standard input is empty: nothing to send", param_hint="TEXT")
    return text


@dataclass
class Reply:
    """The turn that answered a message: its outcome and what the model said."""

    turn_id: str | None = None
    outcome: str | None = None
    error: str | None = None
    texts: list[str] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        """`send --wait --json`'s keys besides the seq."""
        return {
            "turn_id": self.turn_id,
            "outcome": self.outcome,
            "error": self.error,
            "reply": "\n".join(self.texts),
        }


def wait_for_reply(
    client: Client,
    session_id: str,
    after: int,
    deadline: float,
    *,
    echo: bool,
    reconnect: Reconnect | None = None,
    live: Live | JsonDeltas | None = None,
) -> Reply | None:
    """Follow the turn that starts after seq `after` until it ends (printing it as it goes
    if `echo`, and its live output with `live`); None on timeout.

    Events of a turn already in flight (which did not read the message) are skipped. With
    `reconnect`, a restart of the daemon is ridden out: the stream resumes after the last
    event it saw, so each line is printed once, and a turn the restart cut is followed into
    its continuation (the same turn).
    """
    from supervisor.cli.client import ClientTimeout

    reply = Reply()
    try:
        events = client.stream(
            session_id, after, deadline=deadline, reconnect=reconnect, deltas=live is not None
        )
        for event in events:
            if event["type"] == DELTA:
                if live is not None and event["turn"] == reply.turn_id:
                    live.delta(event)
                continue
            kind, payload, turn_id = event["type"], event["payload"], event["turn_id"]
            if reply.turn_id is None and kind == "turn_started":
                reply.turn_id = turn_id
            if turn_id is not None and turn_id != reply.turn_id:
                continue
            line = reply_line(reply, kind, payload)
            shown = live is not None and live.shown(kind, payload)
            if echo and line is not None and not shown:
                click.echo(line)
            if kind == "turn_ended":
                return reply
    except ClientTimeout:
        return None
    return None


def reply_line(reply: Reply, kind: str, payload: dict[str, Any]) -> str | None:
    """Record an event of the turn in `reply`; the line `send --wait` prints for it."""
    if kind == "model_response" and payload.get("text"):
        reply.texts.append(payload["text"])
        return str(payload["text"])
    if kind == "tool_call":
        return f"[tool {payload.get('name', '?')}]"
    if kind == "notice":
        return f"[notice] {payload.get('text', '')}"
    if kind == "turn_ended":
        reply.outcome, reply.error = payload.get("outcome"), payload.get("error")
        if reply.outcome != TurnOutcome.COMPLETED:
            return f"[turn {reply.outcome}] {reply.error or ''}".rstrip()
    return None


@click.command("attach")
@session_argument
@click.option(
    "--after",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Only events with a larger seq (0: the whole history first).",
)
@click.option(
    "--no-reconnect",
    is_flag=True,
    help="Exit (code 3) when the daemon goes away, instead of waiting for it to come back.",
)
@click.option(
    "--no-stream",
    is_flag=True,
    help="Print only committed events, not the text of turns as the model streams it.",
)
@json_option
@click.pass_context
@reports_errors
def attach(
    ctx: click.Context,
    session_id: str,
    after: int,
    no_reconnect: bool,
    no_stream: bool,
    as_json: bool,
) -> None:
    """Print a session's events as they are committed, until Ctrl-C.

    When the daemon restarts, attach says so on stderr, waits for it and resumes after the
    last event it printed: nothing is printed twice or missed. On a terminal the text of a
    turn is printed as the model streams it, before its committed events. --json prints
    each event as one JSON object a line, and each delta of live output as one too
    (`"type": "delta"`, no seq). --no-stream prints only committed events.
    """
    import json

    live = streaming(as_json, no_stream)
    try:
        with connect(ctx) as client:
            reconnect = None if no_reconnect else reconnecting(client.address)
            events = client.stream(session_id, after, reconnect=reconnect, deltas=live is not None)
            for event in events:
                if event["type"] == DELTA and live is not None:
                    live.delta(event)
                    continue
                if live is not None:
                    live.shown(event["type"], event["payload"])  # ends a streamed line
                click.echo(json.dumps(event, sort_keys=True) if as_json else event_line(event))
    except KeyboardInterrupt:
        pass


def reconnecting(where: str, *, from_start: bool = False) -> Reconnect:
    """How `attach` and `send --wait` ride out a restart of the daemon: a line on stderr
    when they lose it and one when they are back."""
    from supervisor.cli.client import Reconnect

    return Reconnect(
        lost=lambda why: click.echo(
            f"turnkeeper: lost the daemon at {where} ({why}); reconnecting", err=True
        ),
        back=lambda seq: click.echo(
            f"turnkeeper: reconnected to the daemon at {where}; resuming after seq {seq}",
            err=True,
        ),
        from_start=from_start,
    )


def event_line(event: dict[str, Any]) -> str:
    """One line of an event: seq, time, type, summary."""
    from supervisor.cli.session_commands import event_head, summarize

    head = event_head(event["seq"], event["created_at"], event["type"])
    return f"{head}  {summarize(event['payload'])}"


@click.command("interrupt")
@session_argument
@json_option
@click.pass_context
@reports_errors
def interrupt(ctx: click.Context, session_id: str, as_json: bool) -> None:
    """End the turn in flight (it is not continued); says whether one was running."""
    with connect(ctx) as client:
        seq = client.interrupt(session_id)
    if as_json:
        emit_json({"interrupted": seq is not None, "seq": seq})
    elif seq is None:
        click.echo("nothing was running: no turn to interrupt")
    else:
        click.echo(f"interrupted the turn in flight (turn_ended at seq {seq})")


@click.command("status")
@json_option
@click.pass_context
@reports_errors
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the daemon: boot, the configuration in force, breaker, worker slots and their
    MCP servers, restarts, sessions, attach streams, its host id and the other hosts on the
    database, if any (--json: the /v1/status document).

    The daemon is found where it published itself (docs: "How the command line finds
    the daemon"). Exit 3 if none runs, 4 if this user cannot tell (it may not read the
    daemon's directories or token)."""
    with connect(ctx) as client:
        data = client.status()
    if as_json:
        emit_json(data)
    else:
        click.echo("\n".join(status_lines(data)))


def status_lines(data: dict[str, Any]) -> list[str]:
    """`turnkeeper status` for a person: short lines and tables that fit 80 columns."""
    boot = data["boot"]
    state = "stopping" if boot["stopping"] else "ready" if boot["ready"] else "starting"
    lines = [f"boot {boot['id']}  {state}"]
    breaker = data.get("breaker") or {}
    if breaker:
        tripped = bool(breaker["tripped"])
        line = f"breaker {'TRIPPED' if tripped else 'clear'}: {breaker['reason']}"
        lines.append(colour(line, "red") if tripped else line)
    lines += slot_table(data["slots"])
    lines += mcp_table(data["slots"])
    model = data.get("model") or {"state": "ok"}
    if model["state"] == "ok":
        lines.append("model ok")
    else:
        lines.append(colour(f"model UNAVAILABLE since {when(model['since'])}: retrying", "red"))
    config = data.get("config")
    if config:  # the one in force (`turnkeeper reload` replaces it); its file: --json
        lines.append(f"configuration {config['version']} loaded {when(config.get('loaded_at'))}")
    sessions = data["sessions"]
    lines += [
        f"worker restarts {data['worker_restarts']}",
        f"sessions {sessions.get('open', 0)} open "
        f"({sessions.get('running', 0)} running, {sessions.get('pending', 0)} pending), "
        f"{sessions.get('quarantined', 0)} quarantined, {sessions.get('closed', 0)} closed",
        f"attach streams {data['attach_streams']}",
    ]
    return lines + hosts_command.status_lines(data)


SLOT_COLOURS = {SlotState.FATAL: "red", SlotState.BACKOFF: "yellow"}
MCP_COLOURS = {McpState.DOWN: "red", McpState.BACKOFF: "yellow"}
SLOT_HEADERS = ["SLOT", "STATE", "WORKER", "PID", "SPARE", "SESSIONS", "IN-FLIGHT", "SERVED"]


def slot_table(slots: list[dict[str, Any]]) -> list[str]:
    """One row a slot: its worker, the sessions it holds, turns in flight and served."""
    rows = [
        [
            str(s["slot"]),
            s["state"],
            s.get("worker") or "-",
            str(s.get("pid") or "-"),
            "yes" if s.get("spare") else "no",
            str(s.get("sessions", 0)),
            str(s.get("turns", 0)),
            str(s.get("turns_served", "-")),
        ]
        for s in slots
    ]
    return coloured(SLOT_HEADERS, rows, [SLOT_COLOURS.get(s["state"]) for s in slots])


def mcp_table(slots: list[dict[str, Any]]) -> list[str]:
    """One row an MCP server of a worker, with its state; nothing if there are none."""
    servers = [
        (slot.get("worker") or "-", server) for slot in slots for server in slot.get("mcp") or []
    ]
    if not servers:
        return []
    rows = [[worker, s["name"], s["state"]] for worker, s in servers]
    fg = [MCP_COLOURS.get(s["state"]) for _, s in servers]
    return coloured(["WORKER", "MCP SERVER", "STATE"], rows, fg)


def coloured(headers: list[str], rows: list[list[str]], fg: list[str | None]) -> list[str]:
    """A table whose rows are coloured whole (a cell's colour would break the widths)."""
    header, *body = table(headers, rows).split("\n")
    return [header, *(colour(line, c) if c else line for line, c in zip(body, fg, strict=True))]


@click.command("grant")
@session_argument
@click.argument("principal")
@click.argument("permission", metavar="PERM", type=click.Choice(PERMISSIONS))
@json_option
@click.pass_context
@reports_errors
def grant(
    ctx: click.Context, session_id: str, principal: str, permission: str, as_json: bool
) -> None:
    """Give PRINCIPAL read, write or admin access to a session (none revokes); prints the ACL."""
    with connect(ctx) as client:
        acl = client.grant(session_id, principal, None if permission == "none" else permission)
    if as_json:
        emit_json({"acl": acl})
    else:
        click.echo(table(["PRINCIPAL", "PERMISSION"], [[p, acl[p]] for p in sorted(acl)]))
