"""The `turnkeeper` command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import click

from supervisor import __version__, locks
from supervisor.cli import daemon_commands, store_commands
from supervisor.cli.budget import SHIPPED_STOP_TIMEOUT, check_stop_timeout, teardown_budget
from supervisor.cli.common import config_error, fail, load, open_store
from supervisor.contract.config import (
    Config,
    ConfigError,
    load_config,
    render_config,
    resolve_paths,
)
from supervisor.contract.logs import log, setup_logging
from supervisor.store import BadStoreURL, Store, StoreError, sqlite_path


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
    """Print the effective configuration (defaults < file < environment), secrets masked.

    Comment lines at the end give the teardown budget: the worst case of a stop, which the
    service manager's stop timeout must be above.
    """
    cfg = load(ctx)
    click.echo(render_config(cfg), nl=False)
    budget = teardown_budget(cfg)
    click.echo("\n# teardown budget (worst case of a stop):")
    for line in budget.lines():
        click.echo(f"#   {line}")
    problem = check_stop_timeout(budget, SHIPPED_STOP_TIMEOUT, "the shipped unit's TimeoutStopSec")
    if problem:
        click.echo(f"# WARNING: {problem}")


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


@main.command("doctor")
@click.option(
    "--unit",
    type=click.Path(exists=True, dir_okay=False),
    help="A systemd unit file to check (stop timeout, KillMode).",
)
@click.option(
    "--supervisord",
    type=click.Path(exists=True, dir_okay=False),
    help="A supervisord program file to check (stopwaitsecs, stopsignal).",
)
@click.pass_context
def doctor_command(ctx: click.Context, unit: str | None, supervisord: str | None) -> None:
    """Check what operators get wrong; each check says PASS, WARN or FAIL and how to fix it.

    Exits 0 when nothing fails.
    """
    from supervisor.cli import doctor

    try:
        cfg = load_config(ctx.obj.get("config_path"))
    except ConfigError as exc:
        click.echo(f"FAIL  config: {exc}")
        sys.exit(1)
    findings = [doctor.Finding(doctor.PASS, "config", "valid")]
    budget = teardown_budget(cfg)
    if unit:
        findings += doctor.check_unit(Path(unit).read_text(), unit, budget)
    if supervisord:
        findings += doctor.check_supervisord(Path(supervisord).read_text(), supervisord, budget)
    paths = resolve_paths(cfg)
    db_file = sqlite_path(paths.db_url)
    tokens_file = Path(cfg.auth.tokens_file) if cfg.auth.tokens_file else None
    findings += doctor.check_files(paths.state_dir, db_file, paths.runtime_dir, tokens_file)
    findings += _doctor_database(cfg, paths.db_url, cfg.store.synchronous, paths.state_dir)
    for finding in findings:
        click.echo(f"{finding.status:4}  {finding.check}: {finding.detail}")
        if finding.fix and finding.status != doctor.PASS:
            click.echo(f"      fix: {finding.fix}")
    sys.exit(doctor.exit_code(findings))


def _doctor_database(cfg: Config, url: str, synchronous: str, state_dir: Path) -> list[Any]:
    from supervisor.cli import doctor

    try:
        store = Store(url, synchronous, migrate=False)
    except (StoreError, OSError) as exc:
        return [
            doctor.Finding(
                doctor.FAIL,
                "database",
                str(exc),
                "start the daemon once, or run `turnkeeper db migrate`",
            )
        ]
    with store:
        findings = [
            doctor.Finding(
                doctor.PASS, "database", f"{store.backend} reachable, schema {store.schema_version}"
            )
        ]
        if store.backend == "sqlite":
            mode = store.db.execute_sql("PRAGMA journal_mode").fetchone()[0]
            level = store.db.execute_sql("PRAGMA synchronous").fetchone()[0]
            findings += doctor.check_sqlite(str(mode), int(level))
        counts = store.sessions.counts()
        quarantined = counts.get("quarantined", 0)
        findings.append(
            doctor.Finding(
                doctor.WARN,
                "quarantine",
                f"{quarantined} sessions quarantined",
                "see `turnkeeper sessions list`; lift with `turnkeeper sessions release ID`",
            )
            if quarantined
            else doctor.Finding(doctor.PASS, "quarantine", "no session quarantined")
        )
        stale = [
            s
            for s in store.sessions.with_work()
            if s.active_turn_id and s.owner and (s.lease_expires_at or 0) < store.now()
        ]
        running = locks.holder(state_dir / locks.LEADER_LOCK) is not None
        from supervisor.cli.store_commands import breaker_state

        state = breaker_state(store, cfg)
        if state.tripped:
            findings.append(
                doctor.Finding(
                    doctor.WARN,
                    "breaker",
                    f"tripped: {state.reason}",
                    "find why the daemon keeps dying (`turnkeeper boots`, the log); once fixed, "
                    "`turnkeeper breaker reset`",
                )
            )
        elif state.fails_open:
            findings.append(
                doctor.Finding(doctor.WARN, "breaker", state.reason, "check the database")
            )
        else:
            findings.append(doctor.Finding(doctor.PASS, "breaker", f"clear: {state.reason}"))
        if stale and running:
            findings.append(
                doctor.Finding(
                    doctor.WARN,
                    "leases",
                    f"{len(stale)} turns in flight with a stale lease while the daemon runs",
                    "check the log for workers that stopped responding",
                )
            )
        else:
            findings.append(
                doctor.Finding(
                    doctor.PASS,
                    "leases",
                    f"{len(stale)} stale leases"
                    + (
                        ""
                        if running
                        else " (the daemon is not running: they are continued at its next start)"
                    ),
                )
            )
    return findings


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
