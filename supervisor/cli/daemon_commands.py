"""Commands that talk to the running daemon over its HTTP API: new, send, attach,
interrupt, status and grant.

`supervisor.cli.main` registers them with `register(main)`. What they use from it is imported
inside the functions, so neither module needs the other to be imported first; so is the
client, so that httpx does not slow down every other command.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import click

from supervisor.core.vocabulary import Permission, SessionKind

if TYPE_CHECKING:
    from supervisor.cli.client import Client

P = ParamSpec("P")
R = TypeVar("R")
KINDS = [kind.value for kind in SessionKind]
PERMISSIONS = [*(permission.value for permission in Permission), "none"]


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    for command in (new, send, attach, interrupt, status, grant):
        group.add_command(command)


def reports_errors(command: Callable[P, R]) -> Callable[P, R]:
    """A ClientError (no daemon, an API error) becomes one line on stderr and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        from supervisor.cli.client import ClientError

        try:
            return command(*args, **kwargs)
        except ClientError as exc:
            from supervisor.cli.common import fail

            fail(str(exc))

    return wrapper


def connect(ctx: click.Context) -> Client:
    """A client of the configured daemon."""
    from supervisor.cli.client import Client
    from supervisor.cli.common import load

    return Client.from_config(load(ctx))


session_argument = click.argument("session_id", metavar="SESSION")


@click.command("new")
@click.option("--title", default="", help="A title to recognise the session by.")
@click.option("--kind", default="attached", show_default=True, type=click.Choice(KINDS))
@click.pass_context
@reports_errors
def new(ctx: click.Context, title: str, kind: str) -> None:
    """Create a session through the daemon; prints its id."""
    with connect(ctx) as client:
        click.echo(client.create_session(title, kind)["id"])


@click.command("send")
@session_argument
@click.argument("text")
@click.option("--wait", is_flag=True, help="Print the reply of the turn that follows.")
@click.option("--key", default=None, help="Idempotency key: the same key is committed once.")
@click.option(
    "--timeout",
    default=120.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for the reply, with --wait.",
)
@click.pass_context
@reports_errors
def send(
    ctx: click.Context, session_id: str, text: str, wait: bool, key: str | None, timeout: float
) -> None:
    """Send a user message; it is committed before this returns."""
    from supervisor.cli.common import fail

    with connect(ctx) as client:
        seq = client.inject(session_id, text, key)
        click.echo(f"committed as seq {seq}", err=True)
        if wait and not print_reply(client, session_id, seq, time.monotonic() + timeout):
            fail(f"no reply within {timeout:g} s")


def print_reply(client: Client, session_id: str, after: int, deadline: float) -> bool:
    """Print the turn that starts after seq `after` until it ends; False on timeout.

    Events of a turn already in flight (which did not read the message) are skipped.
    """
    from supervisor.cli.client import ClientTimeout

    turn: str | None = None
    try:
        for event in client.stream(session_id, after, deadline=deadline):
            kind, payload, turn_id = event["type"], event["payload"], event["turn_id"]
            if turn is None and kind == "turn_started":
                turn = turn_id
            if turn_id is not None and turn_id != turn:
                continue
            if kind == "model_response" and payload.get("text"):
                click.echo(payload["text"])
            elif kind == "tool_call":
                click.echo(f"[tool {payload.get('name', '?')}]")
            elif kind == "notice":
                click.echo(f"[notice] {payload.get('text', '')}")
            elif kind == "turn_ended":
                outcome = payload.get("outcome")
                if outcome != "completed":
                    click.echo(f"[turn {outcome}] {payload.get('error', '')}".rstrip())
                return True
    except ClientTimeout:
        return False
    return False


@click.command("attach")
@session_argument
@click.option(
    "--after",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Only events with a larger seq (0: the whole history first).",
)
@click.pass_context
@reports_errors
def attach(ctx: click.Context, session_id: str, after: int) -> None:
    """Print a session's events as they are committed, until Ctrl-C."""
    try:
        with connect(ctx) as client:
            for event in client.stream(session_id, after):
                click.echo(event_line(event))
    except KeyboardInterrupt:
        pass


def event_line(event: dict[str, Any]) -> str:
    """One line of an event: seq, time, type, summary."""
    from supervisor.cli.common import when
    from supervisor.cli.store_commands import summarize

    return (
        f"{event['seq']:>6}  {when(event['created_at'])}  {event['type']:<15}  "
        f"{summarize(event['payload'])}"
    )


@click.command("interrupt")
@session_argument
@click.pass_context
@reports_errors
def interrupt(ctx: click.Context, session_id: str) -> None:
    """End the turn in flight (it is not continued); says whether one was running."""
    with connect(ctx) as client:
        seq = client.interrupt(session_id)
    if seq is None:
        click.echo("nothing was running: no turn to interrupt")
    else:
        click.echo(f"interrupted the turn in flight (turn_ended at seq {seq})")


@click.command("status")
@click.pass_context
@reports_errors
def status(ctx: click.Context) -> None:
    """Show the daemon: boot, worker slots, restarts, sessions and attach streams."""
    from supervisor.cli.common import table

    with connect(ctx) as client:
        data = client.status()
    boot = data["boot"]
    state = "stopping" if boot["stopping"] else "ready" if boot["ready"] else "starting"
    click.echo(f"boot {boot['id']}  {state}")
    breaker = data.get("breaker") or {}
    if breaker:
        word = "TRIPPED" if breaker["tripped"] else "clear"
        click.echo(f"breaker {word}: {breaker['reason']}")
    rows = [
        [
            str(s["slot"]),
            s["state"],
            s["worker"] or "-",
            str(s["pid"] or "-"),
            "yes" if s["spare"] else "no",
            str(s["sessions"]),
            str(s["turns"]),
        ]
        for s in data["slots"]
    ]
    click.echo(table(["SLOT", "STATE", "WORKER", "PID", "SPARE", "SESSIONS", "TURNS"], rows))
    click.echo(f"worker restarts {data['worker_restarts']}")
    sessions = data["sessions"]
    click.echo(
        f"sessions {sessions.get('open', 0)} open "
        f"({sessions.get('running', 0)} running, {sessions.get('pending', 0)} pending), "
        f"{sessions.get('quarantined', 0)} quarantined, {sessions.get('closed', 0)} closed"
    )
    click.echo(f"attach streams {data['attach_streams']}")


@click.command("grant")
@session_argument
@click.argument("principal")
@click.argument("permission", metavar="PERM", type=click.Choice(PERMISSIONS))
@click.pass_context
@reports_errors
def grant(ctx: click.Context, session_id: str, principal: str, permission: str) -> None:
    """Give PRINCIPAL read, write or admin access to a session (none revokes); prints the ACL."""
    from supervisor.cli.common import table

    with connect(ctx) as client:
        acl = client.grant(session_id, principal, None if permission == "none" else permission)
    click.echo(table(["PRINCIPAL", "PERMISSION"], [[p, acl[p]] for p in sorted(acl)]))
