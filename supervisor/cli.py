"""The `turnkeeper` command line."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import datetime
from typing import NoReturn

import click

from supervisor import __version__
from supervisor.config import (
    Config,
    ConfigError,
    load_config,
    make_private_dir,
    render_config,
    resolve_paths,
)
from supervisor.daemon import Daemon
from supervisor.logs import log, setup_logging
from supervisor.store import BadStoreURL, SessionNotFound, Store, StoreError

EX_CONFIG = 78


def config_error(message: str) -> NoReturn:
    """Print one line naming what to fix and exit 78 (EX_CONFIG), as systemd expects."""
    click.echo(f"turnkeeper: configuration error: {message}", err=True)
    sys.exit(EX_CONFIG)


def load(ctx: click.Context) -> Config:
    """The effective configuration for this invocation, loaded once."""
    obj = ctx.ensure_object(dict)
    if "config" not in obj:
        try:
            obj["config"] = load_config(obj.get("config_path"))
        except ConfigError as exc:
            config_error(str(exc))
    config: Config = obj["config"]
    return config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=str,
    default=None,
    help="Configuration file (default: $TURNKEEPER_CONFIG, else /etc/turnkeeper/turnkeeper.toml"
    " if present, else built-in defaults).",
)
@click.version_option(__version__, prog_name="turnkeeper")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """turnkeeper: a supervisor for AI-agent daemons whose restarts are boring."""
    ctx.ensure_object(dict)["config_path"] = config_path


@main.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@click.pass_context
def config_show(ctx: click.Context) -> None:
    """Print the effective configuration (defaults < file < environment), secrets masked."""
    click.echo(render_config(load(ctx)), nl=False)


def open_store(ctx: click.Context, *, migrate: bool) -> Store:
    """The store of the configured database; errors become one line, not a traceback."""
    cfg = load(ctx)
    paths = resolve_paths(cfg)
    try:
        if migrate:
            make_private_dir(paths.state_dir)
        return Store(paths.db_url, cfg.store.synchronous, migrate=migrate)
    except BadStoreURL as exc:
        config_error(str(exc))
    except (StoreError, OSError) as exc:
        fail(str(exc))


def fail(message: str) -> NoReturn:
    """Print one line and exit 1."""
    click.echo(f"turnkeeper: {message}", err=True)
    sys.exit(1)


def when(epoch: float | None) -> str:
    """A local, second-precision time for tables."""
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [
        max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)
    ]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


@main.command("run")
@click.pass_context
def run(ctx: click.Context) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    cfg = load(ctx)
    setup_logging(cfg.log.level, cfg.log.format)
    try:
        code = asyncio.run(Daemon(cfg).run())
    except BadStoreURL as exc:
        config_error(str(exc))
    except (StoreError, OSError) as exc:
        log("daemon").error("cannot start: {}", exc)
        sys.exit(1)
    sys.exit(code)


@main.group("db")
def db_group() -> None:
    """Manage the database."""


@db_group.command("migrate")
@click.pass_context
def db_migrate(ctx: click.Context) -> None:
    """Create or upgrade the schema (the daemon also does this when it starts)."""
    store = open_store(ctx, migrate=True)
    with store:
        if store.schema_before == store.schema_version:
            click.echo(f"schema is at version {store.schema_version}; nothing to do")
        else:
            click.echo(
                f"schema migrated from version {store.schema_before} "
                f"to {store.schema_version} ({store.backend})"
            )


@main.group("sessions")
def sessions_group() -> None:
    """Inspect sessions in the database."""


@sessions_group.command("list")
@click.option("--limit", default=50, show_default=True, help="Show at most this many.")
@click.pass_context
def sessions_list(ctx: click.Context, limit: int) -> None:
    """List sessions, newest first."""
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


@sessions_group.command("show")
@click.argument("session_id")
@click.option("--after", default=0, show_default=True, help="Only events with a larger seq.")
@click.option("--limit", default=1000, show_default=True, help="Show at most this many events.")
@click.pass_context
def sessions_show(ctx: click.Context, session_id: str, after: int, limit: int) -> None:
    """Show one session and its events, readably."""
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


@main.command("boots")
@click.option("--limit", default=20, show_default=True, help="Show at most this many.")
@click.pass_context
def boots(ctx: click.Context, limit: int) -> None:
    """List recent daemon starts and how each ended (none: still running, or killed)."""
    with open_store(ctx, migrate=False) as store:
        rows = store.boots.recent(limit)
    if not rows:
        click.echo("no boots recorded")
        return
    click.echo(
        table(
            ["BOOT", "HOST", "PID", "VERSION", "STARTED", "ENDED", "OUTCOME"],
            [
                [
                    b.boot_id,
                    b.host,
                    str(b.pid),
                    b.version,
                    when(b.started_at),
                    when(b.ended_at),
                    b.outcome or "-",
                ]
                for b in rows
            ],
        )
    )
