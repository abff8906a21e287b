"""`turnkeeper doctor`, the command: gathers the inputs and prints the findings of
`supervisor.cli.doctor`'s checks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from supervisor import locks
from supervisor.cli.budget import teardown_budget
from supervisor.contract.config import Config, ConfigError, load_config, resolve_paths
from supervisor.store import Store, StoreError, sqlite_path


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    group.add_command(doctor_command)


@click.command("doctor")
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
