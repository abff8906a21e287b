"""Commands that read or write the database directly, so they work while the daemon is
down: boots, the breaker, autonomous runs; and the `sessions` group of
`session_commands.py`, registered with them."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from supervisor.cli.common import json_option
from supervisor.cli.session_commands import sessions_group
from supervisor.core.vocabulary import BootOutcome

if TYPE_CHECKING:
    from supervisor.contract.config import Config
    from supervisor.core.breaker import BreakerState
    from supervisor.store import Store
    from supervisor.store.boots import Boot

# The states `supervisor.store.boot_states` gives a boot with no outcome recorded (named
# here, not imported: the store is imported by the commands that use it, when they run).
RUNNING, CRASHED, UNKNOWN = "running", "crashed", "unknown"
STATE_COLOURS = {
    RUNNING: "green",
    CRASHED: "red",
    BootOutcome.STARTUP_FAILED: "red",
    BootOutcome.UNCLEAN: "red",
    UNKNOWN: "yellow",
}


def register(group: click.Group) -> None:
    """Add the commands of this module, and the `sessions` group, to `group`."""
    for command in (sessions_group, boots, autonomous_group, breaker_group):
        group.add_command(command)


@click.command("boots")
@click.option("--limit", default=20, show_default=True, help="Show at most this many.")
@json_option
@click.pass_context
def boots(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List recent daemon starts, newest first: their state and how each found the breaker.

    STATE is running, crashed (no end recorded and its process is gone: SIGKILL, OOM),
    startup_failed, clean or unclean; unknown for a boot of another host that has no end.
    """
    from supervisor.cli.common import emit_json, load, open_store
    from supervisor.store.boot_states import boot_json, boot_state, process_check

    host = resolved_host_id(load(ctx))
    with open_store(ctx, migrate=False) as store:
        rows = store.boots.recent(limit)
        now = store.now()
        running = process_check(now)
    judged = [(b, boot_state(b, host, running)) for b in rows]
    if as_json:
        emit_json({"host": host, "boots": [boot_json(b, state) for b, state in judged]})
    elif not rows:
        click.echo("no boots recorded")
    else:
        click.echo(_boots_table(judged, now))


def resolved_host_id(config: Config) -> str:
    """This host's id, as its daemon resolves it: boots and the breaker are per host."""
    from supervisor.contract.config import resolved_host_id as resolve

    return resolve(config)


def _boots_table(judged: list[tuple[Boot, str]], now: float) -> str:
    """BOOT (short id), PID, STARTED, RAN, STATE, BREAKER; HOST too for several hosts;
    the breaker resets recorded in these rows below."""
    from supervisor.cli.common import table, when

    rows = [b for b, _ in judged]
    hosts = len({b.host for b in rows}) > 1
    lines = [
        [
            b.boot_id[:12],
            *([b.host] if hosts else []),
            str(b.pid),
            when(b.started_at),
            _ran(b, state, now),
            state,
            _breaker_cell(b.breaker),
        ]
        for b, state in judged
    ]
    headers = ["BOOT", *(["HOST"] if hosts else []), "PID", "STARTED", "RAN", "STATE", "BREAKER"]
    text = table(headers, lines)
    text = paint(text, "STATE", lambda s: STATE_COLOURS.get(s))
    text = paint(text, "BREAKER", lambda s: "red" if s == "TRIPPED" else None)
    resets = [
        f"breaker reset at {when(b.breaker['reset_at'])} (kept in boot {b.boot_id[:12]})"
        for b in rows
        if b.breaker and "reset_at" in b.breaker
    ]
    return "\n".join([text, *resets])


def _ran(boot: Boot, state: str, now: float) -> str:
    """How long the boot ran (so far, while running); `-` when its end is unknown."""
    if boot.ended_at is not None:
        return duration(boot.ended_at - boot.started_at)
    return duration(now - boot.started_at) if state == RUNNING else "-"


def duration(seconds: float) -> str:
    """A short duration: 45s, 12m03s, 3h12m, 2d04h."""
    total = int(max(seconds, 0))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _breaker_cell(state: dict[str, Any] | None) -> str:
    """How the boot found the breaker: TRIPPED, clear, or - (it never judged it)."""
    if not state or "tripped" not in state:
        return "-"
    return "TRIPPED" if state["tripped"] else "clear"


def paint(text: str, column: str, fg_of: Callable[[str], str | None]) -> str:
    """Colour the cells of one column of a `table()` (laid out plain, so it stays aligned)."""
    from supervisor.cli.common import colour

    header, *lines = text.split("\n")
    at = re.search(rf"\b{column}\b", header).start()  # type: ignore[union-attr]
    painted = [header]
    for line in lines:
        cell = line[at:].split("  ", 1)[0]
        fg = fg_of(cell)
        if fg is not None:
            line = line[:at] + colour(cell, fg) + line[at + len(cell) :]
        painted.append(line)
    return "\n".join(painted)


@click.group("autonomous")
def autonomous_group() -> None:
    """Autonomous runs: sessions that work towards a goal on their own, within budgets."""


@autonomous_group.command("resume")
@click.argument("session_id", metavar="[ID]", required=False)
@json_option
@click.pass_context
def autonomous_resume(ctx: click.Context, session_id: str | None, as_json: bool) -> None:
    """Resume autonomous runs that have not stopped: ID, or every one between turns.

    Works while the breaker is tripped (it holds back only what nobody asked for). A run
    with a turn in flight is continued by recovery instead; a stopped run stays stopped.
    """
    from supervisor.cli.common import emit_json, fail, open_store
    from supervisor.store import SessionNotFound

    with open_store(ctx, migrate=False) as store:
        if session_id is None:
            candidates = store.sessions.idle_autonomous()
        else:
            try:
                candidates = [store.sessions.get(session_id)]
            except SessionNotFound:
                fail(f"no session {session_id}")
        results = [_resume(store, info) for info in candidates]
    if as_json:
        emit_json({"runs": [{"id": i, "result": r, "detail": d} for i, r, d in results]})
        return
    for found, _, detail in results:
        click.echo(f"{found}: {detail}")
    if session_id is None:
        click.echo(f"{sum(1 for _, result, _ in results if result == 'resumed')} runs resumed")


def _resume(store: Store, info: Any) -> tuple[str, str, str]:
    """Resume one run if it may be: (its id, what happened in a word, in words)."""
    from supervisor.core import autonomy

    events = store.events.read(info.id, 0, 1_000_000)
    found = autonomy.run_of(events)
    last = autonomy.last_checkpoint(events) or {}
    if found is None:
        return info.id, "not_autonomous", "not an autonomous run"
    if last.get("stop_reason") is not None:
        return info.id, "stopped", f"stopped ({last['stop_reason']}); nothing to resume"
    if info.status != "open":
        return info.id, info.status, f"{info.status}; release it first"
    if info.active_turn_id or info.pending:
        return info.id, "busy", "has a turn in flight or waiting; recovery goes on with it"
    store.events.append(
        info.id,
        "user_message",
        {"text": found[0].prompt, "autonomous": True, "resumed": True},
        writer="cli",
    )
    return info.id, "resumed", f"resumed after {last.get('turns', 0)} turns"


@click.group("breaker")
def breaker_group() -> None:
    """The crash-loop breaker: unclean boots in a short window suppress side work."""


@breaker_group.command("status")
@json_option
@click.pass_context
def breaker_status(ctx: click.Context, as_json: bool) -> None:
    """Judge the breaker of this host from the boot log, as the next boot would.

    Exits 1 while it is tripped, 0 when it is clear.
    """
    from supervisor.cli.common import EX_FAILURE, colour, emit_json, load, open_store

    config = load(ctx)
    with open_store(ctx, migrate=False) as store:
        state = breaker_state(store, config)
    if as_json:
        emit_json(
            {
                "host": resolved_host_id(config),
                "tripped": state.tripped,
                "unclean_boots": state.unclean_in_window,
                "threshold": config.recovery.breaker_threshold,
                "window": config.recovery.breaker_window,
                "clears_at": state.clears_at,
                "fails_open": state.fails_open,
                "reason": state.reason,
            }
        )
    else:
        word = colour("TRIPPED", "red") if state.tripped else "clear"
        click.echo(f"{word}: {state.reason}")
    if state.tripped:
        ctx.exit(EX_FAILURE)


def breaker_state(store: Store, config: Config) -> BreakerState:
    """This host's breaker judged from the boot log, as the running (or next) boot would."""
    from supervisor.core import breaker
    from supervisor.store.boot_states import process_check

    now = store.now()
    try:
        rows = store.boots.of_host(resolved_host_id(config), breaker.prune_before(now))
    except Exception:
        rows = None
    # A boot still running here is the current one, as it judges itself; without one,
    # this is how a boot starting now would judge it.
    running = process_check(now)
    return breaker.judge_rows(
        rows,
        now,
        config.recovery.breaker_threshold,
        config.recovery.breaker_window,
        is_current=lambda row: row.ended_at is None and running(row),
    )


@breaker_group.command("reset")
@click.pass_context
def breaker_reset(ctx: click.Context) -> None:
    """Clear a tripped breaker: boots of this host until now stop counting.

    A running daemon picks the reset up within seconds and runs the boot scan it held
    back; a new crash loop trips the breaker again.
    """
    from supervisor.cli.common import fail, load, open_store, when

    host = resolved_host_id(load(ctx))
    with open_store(ctx, migrate=False) as store:
        try:
            at = store.boots.reset_breaker(host)
        except LookupError as exc:
            fail(str(exc))
    click.echo(f"breaker reset for host {host} at {when(at)}")
