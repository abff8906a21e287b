"""Commands that read or write the database directly, so they work while the daemon is
down: sessions, boots, the breaker, autonomous runs."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import click

from supervisor.contract.config import Config
from supervisor.store import SessionNotFound, Store


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    for command in (sessions_group, boots, autonomous_group, breaker_group):
        group.add_command(command)


@click.group("sessions")
def sessions_group() -> None:
    """Inspect sessions in the database."""


@sessions_group.command("list")
@click.option("--limit", default=50, show_default=True, help="Show at most this many.")
@click.pass_context
def sessions_list(ctx: click.Context, limit: int) -> None:
    """List sessions, newest first."""
    from supervisor.cli.common import open_store, table, when

    with open_store(ctx, migrate=False) as store:
        sessions = store.sessions.list(limit=limit)
    if not sessions:
        click.echo("no sessions")
        return
    rows = [
        [
            s.id,
            s.kind,
            s.status,
            str(s.last_seq),
            s.active_turn_id or "-",
            s.owner or "-",
            when(s.updated_at),
            s.title,
        ]
        for s in sessions
    ]
    click.echo(
        table(["ID", "KIND", "STATUS", "EVENTS", "ACTIVE TURN", "OWNER", "UPDATED", "TITLE"], rows)
    )


@sessions_group.command("release")
@click.argument("session_id")
@click.pass_context
def sessions_release(ctx: click.Context, session_id: str) -> None:
    """Lift a session's quarantine; the user can then send a message again."""
    from supervisor.cli.common import fail, open_store

    with open_store(ctx, migrate=False) as store:
        try:
            released = store.sessions.release(session_id)
        except SessionNotFound as exc:
            fail(str(exc))
    click.echo("released" if released else "the session was not quarantined")


@sessions_group.command("show")
@click.argument("session_id")
@click.option("--after", default=0, show_default=True, help="Only events with a larger seq.")
@click.option("--limit", default=1000, show_default=True, help="Show at most this many events.")
@click.pass_context
def sessions_show(ctx: click.Context, session_id: str, after: int, limit: int) -> None:
    """Show one session and its events, readably."""
    from supervisor.cli.common import fail, open_store, when

    with open_store(ctx, migrate=False) as store:
        try:
            info = store.sessions.get(session_id)
        except SessionNotFound as exc:
            fail(str(exc))
        events = store.events.read(session_id, after=after, limit=limit)
        acl = store.acl.entries(session_id)
    click.echo(
        f"session {info.id}  kind {info.kind}  status {info.status}  "
        f"events {info.last_seq}  title {info.title!r}"
    )
    click.echo(
        f"created {when(info.created_at)}  updated {when(info.updated_at)}  "
        f"active turn {info.active_turn_id or '-'}  "
        f"owner {info.owner or '-'} (token {info.lease_token})"
    )
    click.echo("acl " + ", ".join(f"{p}={perm}" for p, perm in sorted(acl.items())))
    if info.quarantined_at is not None:
        click.echo(f"quarantined {when(info.quarantined_at)}: {info.quarantine_reason}")
    if info.resend_requested_at is not None:
        click.echo(
            f"asked the user to resend {when(info.resend_requested_at)} "
            "(recovery could not continue a turn)"
        )
    for event in events:
        turn = f" turn={event.turn_id}" if event.turn_id else ""
        click.echo(
            f"{event.seq:>6}  {when(event.created_at)}  {event.type:<15}{turn}  "
            f"{summarize(event.payload)}"
        )


def summarize(payload: dict[str, object], width: int = 100) -> str:
    """One line of an event payload: its text if it has one, else compact JSON."""
    text = payload.get("text")
    line = str(text) if isinstance(text, str) else json.dumps(payload, ensure_ascii=False)
    line = " ".join(line.split())
    return line if len(line) <= width else line[: width - 1] + "…"


@click.command("boots")
@click.option("--limit", default=20, show_default=True, help="Show at most this many.")
@click.pass_context
def boots(ctx: click.Context, limit: int) -> None:
    """List recent daemon starts and how each ended (none: still running, or killed)."""
    from supervisor.cli.common import open_store, table, when

    with open_store(ctx, migrate=False) as store:
        rows = store.boots.recent(limit)
    if not rows:
        click.echo("no boots recorded")
        return
    click.echo(
        table(
            ["BOOT", "HOST", "PID", "VERSION", "STARTED", "ENDED", "OUTCOME", "BREAKER"],
            [
                [
                    b.boot_id,
                    b.host,
                    str(b.pid),
                    b.version,
                    when(b.started_at),
                    when(b.ended_at),
                    b.outcome or "-",
                    _breaker_cell(b.breaker),
                ]
                for b in rows
            ],
        )
    )


def _breaker_cell(state: dict[str, Any] | None) -> str:
    """How the boot found the breaker, and a reset recorded in its row."""
    from supervisor.cli.common import when

    if not state or "tripped" not in state:
        cell = "-"
    else:
        cell = "TRIPPED" if state["tripped"] else "clear"
    if "reset_at" in (state or {}):
        cell += f" (reset {when(state['reset_at'])})"  # type: ignore[index]
    return cell


@click.group("autonomous")
def autonomous_group() -> None:
    """Autonomous runs: sessions that work towards a goal on their own, within budgets."""


@autonomous_group.command("resume")
@click.argument("session_id", metavar="[ID]", required=False)
@click.pass_context
def autonomous_resume(ctx: click.Context, session_id: str | None) -> None:
    """Resume autonomous runs that have not stopped: ID, or every one between turns.

    Works while the breaker is tripped (it holds back only what nobody asked for). A run
    with a turn in flight is continued by recovery instead; a stopped run stays stopped.
    """

    from supervisor.cli.common import fail, open_store
    from supervisor.core import autonomy

    with open_store(ctx, migrate=False) as store:
        if session_id is None:
            candidates = store.sessions.idle_autonomous()
        else:
            try:
                candidates = [store.sessions.get(session_id)]
            except SessionNotFound:
                fail(f"no session {session_id}")
        resumed = 0
        for info in candidates:
            events = store.events.read(info.id, 0, 1_000_000)
            found = autonomy.run_of(events)
            last = autonomy.last_checkpoint(events) or {}
            if found is None:
                click.echo(f"{info.id}: not an autonomous run")
            elif last.get("stop_reason") is not None:
                click.echo(f"{info.id}: stopped ({last['stop_reason']}); nothing to resume")
            elif info.status != "open":
                click.echo(f"{info.id}: {info.status}; release it first")
            elif info.active_turn_id or info.pending:
                click.echo(f"{info.id}: has a turn in flight or waiting; recovery goes on with it")
            else:
                store.events.append(
                    info.id,
                    "user_message",
                    {"text": found[0].prompt, "autonomous": True, "resumed": True},
                    writer="cli",
                )
                resumed += 1
                click.echo(f"{info.id}: resumed after {last.get('turns', 0)} turns")
    if session_id is None:
        click.echo(f"{resumed} runs resumed")


@click.group("breaker")
def breaker_group() -> None:
    """The crash-loop breaker: unclean boots in a short window suppress side work."""


@breaker_group.command("status")
@click.pass_context
def breaker_status(ctx: click.Context) -> None:
    """Judge the breaker of this host from the boot log, as the next boot would."""
    from supervisor.cli.common import load, open_store

    config = load(ctx)
    with open_store(ctx, migrate=False) as store:
        state = breaker_state(store, config)
    click.echo(f"{'TRIPPED' if state.tripped else 'clear'}: {state.reason}")


def breaker_state(store: Store, config: Config) -> Any:
    """This host's breaker judged from the boot log, as the running (or next) boot would."""
    from supervisor.core import breaker

    now = store.now()
    try:
        rows = store.boots.of_host(socket.gethostname(), breaker.prune_before(now))
    except Exception:
        rows = None
    # A boot still running here is the current one, as it judges itself; without one,
    # this is how a boot starting now would judge it.
    return breaker.judge_rows(
        rows,
        now,
        config.recovery.breaker_threshold,
        config.recovery.breaker_window,
        is_current=lambda row: row.ended_at is None and _alive(row.pid),
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@breaker_group.command("reset")
@click.pass_context
def breaker_reset(ctx: click.Context) -> None:
    """Clear a tripped breaker: boots of this host until now stop counting.

    A running daemon picks the reset up within seconds and runs the boot scan it held
    back; a new crash loop trips the breaker again.
    """
    from supervisor.cli.common import open_store, when

    host = socket.gethostname()
    with open_store(ctx, migrate=False) as store:
        try:
            at = store.boots.reset_breaker(host)
        except LookupError as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(f"breaker reset for host {host} at {when(at)}")
