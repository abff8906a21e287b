"""The `turnkeeper` command line."""

from __future__ import annotations

import json
import os
import signal
import sys

import click

# A command of the CLI loads no pydantic plugin: looking for them reads the metadata of
# every installed package, ~20 ms of each call. The daemon (`run`) keeps the choice.
if "run" not in sys.argv[1:]:
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

from supervisor import __version__
from supervisor.cli import (
    config_commands,
    daemon_commands,
    doctor_command,
    hosts_command,
    reload_command,
    store_commands,
)
from supervisor.cli.common import (
    CONFIG_HELP,
    EX_UNKNOWN,
    accept_config_everywhere,
    config_error,
    daemon_pid,
    emit_json,
    escape_output,
    fail,
    find_daemon,
    json_option,
    load,
    open_store,
    state_dir_option,
)
from supervisor.contract.clock import SYSTEM
from supervisor.deliveries import cli as deliveries_command
from supervisor.restarts import cli as restart_command
from supervisor.schedules import cli as schedules_command
from supervisor.subagents import cli as subagents_command
from supervisor.tasks import cli as tasks_command


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
    escape_output(ctx)  # what others wrote is shown, never obeyed by the terminal


main.params.insert(1, state_dir_option())  # after --config, as every command has them


@main.command("run")
@click.pass_context
def run(ctx: click.Context) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT.

    A requested restart (`turnkeeper restart`) stops it as SIGTERM would, then starts it
    again in the same process (the same pid) with the same command line."""
    import asyncio
    import faulthandler

    # A crash in native code (a driver, a binding) leaves every thread's Python stack on
    # stderr, in the journal, instead of a bare "signal SIGSEGV".
    faulthandler.enable(all_threads=True)

    from supervisor.contract.logs import log, setup_logging
    from supervisor.daemon import Daemon, PluginError, StartupError  # heavy imports
    from supervisor.store import BadStoreURL, HostTaken, SingleHost, StoreError

    cfg = load(ctx)
    setup_logging(cfg.log.level, cfg.log.format)
    daemon = Daemon(cfg, config_path=ctx.obj.get("config_path"))
    try:
        code = asyncio.run(daemon.run())
    except (BadStoreURL, PluginError, HostTaken, SingleHost) as exc:  # each names its key
        config_error(str(exc))
    except (StartupError, StoreError, OSError) as exc:
        log("daemon").error("cannot start: {}", exc)
        sys.exit(1)
    if code == 0 and daemon.comes_back():  # a requested restart, stopped cleanly: start again
        from supervisor.restarts.service import reexec

        reexec(daemon.notifier)
        code = 1  # it did not happen: an ordinary exit, which the service manager restarts
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
    """Stop the daemon (SIGTERM) and wait until it has exited.

    The daemon is found as every command finds it (docs: "How the command line finds
    the daemon"). A daemon that is not running is not an error (exit 0, as `systemctl
    stop`); one this user cannot see or signal is exit 4, naming what is lacking. Under
    systemd or supervisord this refuses (exit 1) and names the command to use instead:
    the service manager would start the daemon again at once.
    """
    from supervisor.cli import service

    cfg = load(ctx, lenient=True)  # a broken file: a warning; the daemon is found all the same
    found = find_daemon(ctx)
    if found.running is None:
        if found.unknown is not None:
            fail(
                f"cannot tell whether the daemon runs: {found.unknown}: run as the service user",
                EX_UNKNOWN,
            )
        click.echo("the daemon is not running; nothing to stop")
        return
    running = found.running
    pid = running.pid
    manager = service.inspect(pid)
    if manager is not None:
        fail(
            f"the daemon (pid {pid}) runs under {manager.name}, which would start it again at "
            f"once; run `{manager.stop_command}` instead"
        )
    if drain is not None:
        seconds = drain if drain >= 0 else (cfg.shutdown.drain_budget or 15.0)
        request = running.runtime_dir / "stop-request.json"
        request.write_text(json.dumps({"drain": seconds}))
        click.echo(f"draining for up to {seconds:g} s", err=True)
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        fail(f"permission denied signalling the daemon (pid {pid}): run as its user", EX_UNKNOWN)
    progress = _DrainProgress(ctx) if drain is not None and sys.stderr.isatty() else None
    deadline = SYSTEM.monotonic() + timeout
    while daemon_pid(running.state_dir) == pid:
        if SYSTEM.monotonic() > deadline:
            fail(f"pid {pid} has not exited after {timeout:g} s")
        if progress is not None:
            progress.show()
        SYSTEM.sleep_blocking(0.1)
    if progress is not None:
        progress.end()
    click.echo(f"stopped (pid {pid})")


class _DrainProgress:
    """`stop --drain` on a terminal: the turns still in flight, on one updated line."""

    def __init__(self, ctx: click.Context) -> None:
        self.ctx, self.shown, self.next_at = ctx, False, 0.0

    def show(self) -> None:
        if SYSTEM.monotonic() < self.next_at:
            return
        self.next_at = SYSTEM.monotonic() + 0.5
        from supervisor.cli.client import ClientError
        from supervisor.cli.common import connect

        try:
            with connect(self.ctx) as client:
                slots = client.status()["slots"]
        except (ClientError, KeyError, TypeError):
            return  # it stopped listening: the drain is over, or it is not ours to read
        turns = sum(int(slot.get("turns") or 0) for slot in slots)
        click.echo(f"\rdraining: {turns} turns in flight ", nl=False, err=True)
        self.shown = True

    def end(self) -> None:
        if self.shown:
            click.echo("", err=True)


@main.group("db")
def db_group() -> None:
    """Manage the database."""


@db_group.command("migrate")
@json_option
@click.pass_context
def db_migrate(ctx: click.Context, as_json: bool) -> None:
    """Create or upgrade the schema (the daemon also does this when it starts)."""
    store = open_store(ctx, migrate=True)
    with store:
        if as_json:
            before, after = store.schema_before, store.schema_version
            emit_json({"backend": store.backend, "schema_before": before, "schema": after})
            return
        if store.schema_before == store.schema_version:
            click.echo(f"schema is at version {store.schema_version}; nothing to do")
        else:
            click.echo(
                f"schema migrated from version {store.schema_before} "
                f"to {store.schema_version} ({store.backend})"
            )


daemon_commands.register(main)
store_commands.register(main)
hosts_command.register(main)
subagents_command.register(main)
schedules_command.register(main)
tasks_command.register(main)
deliveries_command.register(main)
restart_command.register(main)
reload_command.register(main)
config_commands.register(main)
doctor_command.register(main)
accept_config_everywhere(main)  # last: after every command is registered
