"""`turnkeeper doctor`, the command: gathers the inputs, runs `supervisor.cli.doctor`'s
checks and the ones `turnkeeper run` makes (`supervisor.checks`), prints the findings.

Imports are taken inside the command: this module is loaded by every `turnkeeper` call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from supervisor.cli.common import EX_CONFIG, colour, daemon_pid, emit_json, json_option

if TYPE_CHECKING:
    from supervisor.cli.doctor import Finding
    from supervisor.contract.config import Config, Paths

COLOURS = {"PASS": "green", "WARN": "yellow", "FAIL": "red"}


def register(group: click.Group) -> None:
    """Add the commands of this module to `group`."""
    group.add_command(doctor_command)


@click.command("doctor")
@click.option(
    "--unit",
    type=click.Path(exists=True, dir_okay=False),
    help="A systemd unit file to check (TimeoutStopSec above the teardown budget, KillMode,"
    " LimitNOFILE; with PrivateTmp=yes, no state under /tmp or /var/tmp).",
)
@click.option(
    "--supervisord",
    type=click.Path(exists=True, dir_okay=False),
    help="A supervisord program file to check (stopwaitsecs above the teardown budget,"
    " stopsignal).",
)
@json_option
@click.pass_context
def doctor_command(
    ctx: click.Context, unit: str | None, supervisord: str | None, as_json: bool
) -> None:
    """Check what operators get wrong; each check says PASS, WARN or FAIL and how to fix it.

    Every check `turnkeeper run` makes before it starts is made here the same way (the agent
    classes are loaded in a child process; MCP servers are never started), each named by
    its configuration key. The teardown budget (`turnkeeper config show` prints its steps)
    must be below the stop timeout of the unit or program file given (a FAIL), or without
    one, of the shipped files (a WARN). The file descriptor limit the daemon gets (the
    unit's LimitNOFILE, else this shell's hard limit) must hold http.max_connections and
    what the daemon keeps open besides (a WARN: it would serve fewer; a FAIL below that).
    A state directory or database on memory (tmpfs), or in the /tmp the unit's
    PrivateTmp=yes removes at every stop, is a FAIL. Exits 0 when nothing fails, 1 when
    something does, 78 when the configuration itself cannot be loaded.
    """
    from supervisor.cli import doctor
    from supervisor.contract.config import ConfigError, load_config, resolve_paths

    try:
        cfg = load_config(ctx.obj.get("config_path"))
    except ConfigError as exc:
        fix = "correct the file or variable named; `turnkeeper config show` checks it"
        _report([doctor.Finding(doctor.FAIL, "config", str(exc), fix)], as_json, EX_CONFIG)
    findings = [doctor.Finding(doctor.PASS, "config", "loads")]
    cfg = _of_the_running_daemon(cfg)
    paths = resolve_paths(cfg)
    running = daemon_pid(paths)
    findings += _service_files(cfg, unit, supervisord)
    findings += _descriptors(cfg, unit, running)
    findings += _run_checks(cfg, paths, running)
    findings += _files_and_database(cfg, paths, running)
    findings += _storage(paths, unit, running)
    _report(findings, as_json, doctor.exit_code(findings))


def _of_the_running_daemon(cfg: Config) -> Config:
    """`cfg` with the directories of the daemon that runs where every command looks
    (`supervisor.cli.discovery`: the service's /var/lib/turnkeeper before the user's), so
    that doctor run on a service's host without its environment checks that daemon's
    files; `cfg` as it is when none runs or it names its own directories."""
    from supervisor.cli import discovery

    try:
        running = discovery.find(cfg).running
    except OSError:
        return cfg
    if running is None:
        return cfg
    update = {"state_dir": str(running.state_dir), "runtime_dir": str(running.runtime_dir)}
    return cfg.model_copy(update={"daemon": cfg.daemon.model_copy(update=update)})


def _report(findings: list[Finding], as_json: bool, code: int) -> NoReturn:
    """Print the findings (text or `--json`) and exit `code`."""
    from dataclasses import asdict

    if as_json:
        emit_json({"ok": code == 0, "findings": [asdict(f) for f in findings]})
        sys.exit(code)
    for finding in findings:
        status = colour(f"{finding.status:4}", COLOURS[finding.status])
        click.echo(f"{status}  {finding.check}: {finding.detail}")
        if finding.fix and finding.status != "PASS":
            click.echo(f"      fix: {finding.fix}")
    sys.exit(code)


def _service_files(cfg: Config, unit: str | None, supervisord: str | None) -> list[Finding]:
    """The service manager's files, against the teardown budget; without one, the stop
    timeout the shipped files set."""
    from supervisor.cli import doctor
    from supervisor.teardown import teardown_budget

    budget = teardown_budget(cfg)
    findings = []
    if unit:
        findings += doctor.check_unit(Path(unit).read_text(), unit, budget)
    if supervisord:
        findings += doctor.check_supervisord(Path(supervisord).read_text(), supervisord, budget)
    if not unit and not supervisord:
        findings.append(doctor.check_shipped_stop_timeout(budget))
    return findings


def _descriptors(cfg: Config, unit: str | None, running: int | None) -> list[Finding]:
    """The file descriptor limit the daemon gets (the unit's, else this process's hard
    limit; the running daemon's too) against http.max_connections and what it keeps."""
    from supervisor.cli.doctor_descriptors import check_descriptors

    return check_descriptors(cfg, (Path(unit).read_text(), unit) if unit else None, running)


def _run_checks(cfg: Config, paths: Paths, running: int | None) -> list[Finding]:
    """What `run` checks before it starts, each verdict a finding named by its key, and
    whether the listen address can be bound (`running`: the daemon's pid, if it runs)."""
    from supervisor import checks
    from supervisor.cli import doctor

    verdicts = list(checks.verdicts(cfg, user=doctor.service_user(paths.state_dir)))
    verdicts.append(checks.listen_verdict(cfg.http.listen, running))
    return [
        doctor.Finding(
            doctor.PASS if verdict.ok else doctor.FAIL,
            verdict.key,
            verdict.detail.removeprefix(verdict.key).removeprefix(":").strip(),
            "" if verdict.ok else verdict.fix,
        )
        for verdict in verdicts
        if not verdict.untrusted  # reported by the `files` check, with the others
    ]


def _files_and_database(cfg: Config, paths: Paths, running: int | None) -> list[Finding]:
    """The files the daemon trusts, and the database it would open."""
    from supervisor.cli import doctor
    from supervisor.cli.doctor_database import check_database
    from supervisor.store import sqlite_path

    tokens = Path(cfg.auth.tokens_file) if cfg.auth.tokens_file else None
    findings = doctor.check_files(
        paths.state_dir, sqlite_path(paths.db_url), paths.runtime_dir, tokens
    )
    return findings + check_database(cfg, paths.db_url, daemon_running=running is not None)


def _storage(paths: Paths, unit: str | None, running: int | None) -> list[Finding]:
    """The state directory and the database on storage that survives a stop and a reboot,
    judged by the running daemon's mount table when it can be read (its private /tmp, if
    any, is its own), else by this process's, and by the unit's PrivateTmp=."""
    from supervisor.cli import doctor
    from supervisor.preflight import MOUNT_TABLE, volatile_storage

    table = MOUNT_TABLE
    if running is not None and os.access(f"/proc/{running}/mountinfo", os.R_OK):
        table = Path(f"/proc/{running}/mountinfo")
    private = unit is not None and doctor.private_tmp(Path(unit).read_text())
    return doctor.check_storage(volatile_storage(paths, private, table), paths.state_dir)
