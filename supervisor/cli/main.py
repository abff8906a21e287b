"""The `turnkeeper` command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import click

from supervisor import __version__, locks
from supervisor.cli import config_commands, daemon_commands, doctor_command, store_commands
from supervisor.cli.common import (
    CONFIG_HELP,
    accept_config_everywhere,
    config_error,
    fail,
    load,
    open_store,
)
from supervisor.contract.config import (
    resolve_paths,
)
from supervisor.contract.logs import log, setup_logging
from supervisor.store import BadStoreURL, StoreError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    type=str,
    default=None,
    help=CONFIG_HELP,
)
@click.version_option(__version__, prog_name="turnkeeper")
@click.pass_context
def main(ctx: click.Context, config_path: str | None) -> None:
    """turnkeeper: a supervisor for AI-agent daemons whose restarts are boring."""
    ctx.ensure_object(dict)["config_path"] = config_path


@main.command("run")
@click.pass_context
def run(ctx: click.Context) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    from supervisor.daemon import Daemon, PluginError, StartupError  # heavy imports

    cfg = load(ctx)
    setup_logging(cfg.log.level, cfg.log.format)
    try:
        code = asyncio.run(Daemon(cfg).run())
    except (BadStoreURL, PluginError) as exc:
        config_error(str(exc))
    except (StartupError, StoreError, OSError) as exc:
        log("daemon").error("cannot start: {}", exc)
        sys.exit(1)
    # The boot row is ended and every child reaped; the interpreter's own teardown adds
    # nothing but time to a stop.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@main.command("stop")
@click.option(
    "--drain",
    type=float,
    is_flag=False,
    flag_value=-1.0,
    default=None,
    metavar="[SECONDS]",
    help="Let turns in flight finish first, up to SECONDS (bare: shutdown.drain_budget,"
    " or 15 if that is 0). Intake refuses from the first moment.",
)
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for the exit.")
@click.pass_context
def stop(ctx: click.Context, drain: float | None, timeout: float) -> None:
    """Stop the daemon (SIGTERM) and wait until it has exited."""
    cfg = load(ctx)
    paths = resolve_paths(cfg)
    pid = locks.holder(paths.state_dir / locks.LEADER_LOCK)
    if pid is None:
        fail("the daemon is not running (no process holds its lock)")
    if drain is not None:
        seconds = drain if drain >= 0 else (cfg.shutdown.drain_budget or 15.0)
        request = paths.runtime_dir / "stop-request.json"
        request.write_text(json.dumps({"drain": seconds}))
        click.echo(f"draining for up to {seconds:g} s", err=True)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while locks.holder(paths.state_dir / locks.LEADER_LOCK) == pid:
        if time.monotonic() > deadline:
            fail(f"pid {pid} has not exited after {timeout:g} s")
        time.sleep(0.1)
    click.echo(f"stopped (pid {pid})")


@main.command("reload")
@click.pass_context
def reload(ctx: click.Context) -> None:
    """Rolling restart of the workers (sends SIGHUP to the daemon): no turn is lost."""
    pid = locks.holder(resolve_paths(load(ctx)).state_dir / locks.LEADER_LOCK)
    if pid is None:
        fail("the daemon is not running (no process holds its lock)")
    os.kill(pid, signal.SIGHUP)
    click.echo(f"rolling restart requested (pid {pid})")


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


daemon_commands.register(main)
store_commands.register(main)
config_commands.register(main)
doctor_command.register(main)
accept_config_everywhere(main)  # last: after every command is registered
