"""`turnkeeper doctor`: checks of what operators get wrong, each with a verdict and a fix.

Every check is a function returning `Finding`s; reading files and the database happens in
the caller-supplied inputs, and the parsing and judging below is plain code. The checks
`turnkeeper run` makes of the configuration are `supervisor.checks`, shared with it.
"""

from __future__ import annotations

import configparser
import re
import shutil
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor import locks, trust
from supervisor.teardown import SHIPPED_STOP_TIMEOUT, Budget, check_stop_timeout

if TYPE_CHECKING:
    from supervisor.preflight import Volatile

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
MIN_FREE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class Finding:
    """One check's verdict: PASS, WARN or FAIL, what was found, and how to fix it."""

    status: str
    check: str
    detail: str
    fix: str = ""


_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(seconds?|sec|s|minutes?|min|ms|m|hours?|hr|h|us)?(?![a-z])")
_UNIT_SECONDS = {
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1,
    "sec": 1,
    "second": 1,
    "seconds": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "minutes": 60,
    "h": 3600,
    "hr": 3600,
    "hour": 3600,
    "hours": 3600,
}


def parse_timespan(text: str) -> float:
    """A systemd time span ("30", "30s", "1min 30s", "infinity") in seconds."""
    text = text.strip()
    if text == "infinity":
        return float("inf")
    total, end = 0.0, 0
    for match in _SPAN.finditer(text):
        if text[end : match.start()].strip():
            raise ValueError(f"not a time span: {text!r}")
        total += float(match[1]) * _UNIT_SECONDS[match[2] or "s"]
        end = match.end()
    if end == 0 or text[end:].strip():
        raise ValueError(f"not a time span: {text!r}")
    return total


def _stop_timeout(setting: str, raw: str, parse: Callable[[str], float], budget: Budget) -> Finding:
    """The verdict on one service manager's stop timeout against the teardown budget."""
    try:
        seconds = parse(raw)
    except ValueError:
        return Finding(
            FAIL,
            "stop timeout",
            f"{setting}={raw} is not a number of seconds",
            "write it as seconds, e.g. 30",
        )
    problem = check_stop_timeout(budget, seconds, setting)
    if problem:
        return Finding(FAIL, "stop timeout", problem, f"raise {setting.rsplit(' ', 1)[-1]}")
    return Finding(
        PASS, "stop timeout", f"{setting}={raw} is above the teardown budget of {budget.total:g} s"
    )


def check_shipped_stop_timeout(budget: Budget) -> Finding:
    """Without a unit or program file to read: the budget against the stop timeout the
    shipped ones set. A WARN, not a FAIL: the installed file may say otherwise."""
    what = "the shipped stop timeout (TimeoutStopSec, stopwaitsecs)"
    problem = check_stop_timeout(budget, SHIPPED_STOP_TIMEOUT, what)
    if problem:
        return Finding(
            WARN,
            "stop timeout",
            problem,
            "raise TimeoutStopSec (systemd) or stopwaitsecs (supervisord) above the budget, "
            "and check the installed file with --unit or --supervisord",
        )
    return Finding(
        PASS,
        "stop timeout",
        f"the teardown budget of {budget.total:g} s is below the shipped TimeoutStopSec and "
        f"stopwaitsecs ({SHIPPED_STOP_TIMEOUT:g} s); --unit or --supervisord checks the "
        "installed file",
    )


def unit_settings(text: str, section: str = "Service") -> dict[str, str]:
    """The settings of one section of a unit file (the last one wins, as in systemd)."""
    settings: dict[str, str] = {}
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and "=" in line and not line.startswith(("#", ";")):
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def check_unit(text: str, name: str, budget: Budget) -> list[Finding]:
    """A systemd unit: stop timeout above the budget, KillMode=mixed, Type=notify."""
    service = unit_settings(text)
    findings = []
    raw_timeout = service.get("TimeoutStopSec", "90")  # systemd's DefaultTimeoutStopSec
    findings.append(_stop_timeout(f"{name}: TimeoutStopSec", raw_timeout, parse_timespan, budget))
    kill_mode = service.get("KillMode", "control-group")
    if kill_mode == "mixed":
        findings.append(Finding(PASS, "KillMode", f"{name}: KillMode=mixed"))
    else:
        findings.append(
            Finding(
                FAIL,
                "KillMode",
                f"{name}: KillMode={kill_mode}: systemd signals every process "
                "of the service at once, so workers and MCP servers die before turnkeeper can "
                "stop them in order",
                "set KillMode=mixed",
            )
        )
    if service.get("Type") != "notify":
        findings.append(
            Finding(
                WARN,
                "Type",
                f"{name}: Type={service.get('Type', 'simple')}: systemd will not wait for READY=1",
                "set Type=notify",
            )
        )
    return findings


def check_supervisord(text: str, name: str, budget: Budget) -> list[Finding]:
    """A supervisord program section: stopwaitsecs above the budget, stopsignal TERM."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.read_string(text)
    programs = [s for s in parser.sections() if s.startswith("program:")]
    if not programs:
        return [
            Finding(
                FAIL,
                "supervisord",
                f"{name}: no [program:...] section",
                "point --supervisord at turnkeeper's program file",
            )
        ]
    findings = []
    for program in programs:
        section = parser[program]
        raw = section.get("stopwaitsecs", "10")  # supervisord's default
        findings.append(_stop_timeout(f"{name} [{program}]: stopwaitsecs", raw, float, budget))
        signal_name = section.get("stopsignal", "TERM").upper().removeprefix("SIG")
        if signal_name != "TERM":
            findings.append(
                Finding(
                    FAIL,
                    "stopsignal",
                    f"{name} [{program}]: stopsignal={signal_name}",
                    "set stopsignal=TERM",
                )
            )
        if section.getboolean("killasgroup", False) or section.getboolean("stopasgroup", False):
            findings.append(
                Finding(
                    WARN,
                    "process group",
                    f"{name} [{program}]: "
                    "stopasgroup/killasgroup signal turnkeeper's workers directly",
                    "set both to false: turnkeeper stops its own tree",
                )
            )
    return findings


def trusted_paths(
    state_dir: Path, runtime_dir: Path | None, db_path: Path | None, tokens_file: Path | None
) -> list[tuple[Path, trust.Expect]]:
    """Every path the daemon judges (`supervisor.trust`) before it trusts it."""
    paths = [
        (state_dir, trust.STATE_DIR),
        (state_dir / "admin.token", trust.ADMIN_TOKEN),
        (state_dir / locks.LEADER_LOCK, trust.LOCK_FILE),
    ]
    if runtime_dir is not None:
        paths += [
            (runtime_dir, trust.RUNTIME_DIR),
            (runtime_dir / locks.CONTROL_LOCK, trust.LOCK_FILE),
        ]
    if tokens_file is not None:
        paths.append((tokens_file, trust.TOKENS_FILE))
    if db_path is not None:
        if db_path.parent != state_dir:
            paths.append((db_path.parent, trust.DATABASE_DIR))
        paths += [(path, trust.DATABASE) for path in trust.database_files(db_path)]
    return paths


def service_user(state_dir: Path) -> int:
    """Whose files these are: doctor's own user, or, run as root, the state directory's owner
    (the user the service runs as)."""
    user = trust.effective_user()
    if user == 0:
        try:
            return state_dir.stat().st_uid
        except OSError:
            return 0
    return user


def check_files(
    state_dir: Path,
    db_path: Path | None,
    runtime_dir: Path | None = None,
    tokens_file: Path | None = None,
    user: int | None = None,
) -> list[Finding]:
    """What the daemon refuses to start on (the tokens file's lines are `supervisor.checks`'),
    the state directory and database kept private, free disk space."""
    user = service_user(state_dir) if user is None else user
    findings = []
    if not state_dir.exists():
        findings.append(
            Finding(
                WARN,
                "file modes",
                f"{state_dir} does not exist yet",
                "start the daemon or run `turnkeeper db migrate`",
            )
        )
    paths = trusted_paths(state_dir, runtime_dir, db_path, tokens_file)
    problems = [p for p in (trust.check(path, expect, user) for path, expect in paths) if p]
    findings += [
        Finding(FAIL, "files", f"{p.expect.what} {p.path} {p.reason}", p.fix) for p in problems
    ]
    if not problems:
        findings.append(
            Finding(
                PASS,
                "files",
                f"{sum(path.exists() for path, _ in paths)} paths turnkeeper trusts: owned by "
                + ("root" if user == 0 else f"{trust.user_name(user)} or root")
                + ", writable by nobody else, no symbolic link where a file belongs",
            )
        )
    findings += _privacy(state_dir, db_path)
    if state_dir.exists():
        free = shutil.disk_usage(state_dir).free
        verdict = PASS if free >= MIN_FREE_BYTES else WARN
        findings.append(
            Finding(
                verdict,
                "disk space",
                f"{free // 2**20} MiB free in {state_dir}",
                "" if verdict == PASS else "free disk space: a full disk stops every commit",
            )
        )
    return findings


def _privacy(state_dir: Path, db_path: Path | None) -> list[Finding]:
    """Others may not read the conversations; listing the state directory is a lesser worry."""
    findings = []
    for path, wanted, verdict in (
        (state_dir, 0o700, WARN),
        *(((db_path, 0o600, FAIL),) if db_path else ()),
    ):
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            continue
        if mode & 0o077:
            findings.append(
                Finding(
                    verdict,
                    "file modes",
                    f"{path} is {mode:04o}: others can read it",
                    f"chmod {wanted:04o} {path}",
                )
            )
        else:
            findings.append(Finding(PASS, "file modes", f"{path} is {mode:04o}"))
    return findings


def private_tmp(unit_text: str) -> bool:
    """Whether a systemd unit gives the service a /tmp of its own (`PrivateTmp=`): yes,
    or `disconnected`; anything but a false boolean."""
    value = unit_settings(unit_text).get("PrivateTmp", "no").lower()
    return value not in ("no", "false", "off", "0", "")


def check_storage(problems: Sequence[Volatile], state_dir: Path) -> list[Finding]:
    """The state directory and the database on storage that survives a stop and a reboot:
    each of `problems` (`supervisor.preflight.volatile_storage`) is a FAIL."""
    if not problems:
        return [Finding(PASS, "storage", f"{state_dir} is not on memory or in a private /tmp")]
    return [
        Finding(
            FAIL,
            "storage",
            f"{p.what} {p.path} {p.reason}",
            f"{p.fix}: what is committed there is lost",
        )
        for p in problems
    ]


def check_sqlite(journal_mode: str, synchronous: int) -> list[Finding]:
    """The durability settings SQLite actually runs with."""
    findings = [
        Finding(PASS, "journal mode", "WAL")
        if journal_mode.lower() == "wal"
        else Finding(
            FAIL,
            "journal mode",
            f"journal_mode={journal_mode}",
            "let the daemon open it (it sets WAL), or run `turnkeeper db migrate`",
        ),
    ]
    names = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
    level = names.get(synchronous, str(synchronous))
    if synchronous >= 2:
        findings.append(Finding(PASS, "synchronous", level))
    elif synchronous == 1:
        findings.append(
            Finding(
                WARN,
                "synchronous",
                "NORMAL: survives process crashes, not a power loss",
                'set store.synchronous = "full" unless you mean it',
            )
        )
    else:
        findings.append(Finding(FAIL, "synchronous", level, 'set store.synchronous = "full"'))
    return findings


def exit_code(findings: list[Finding]) -> int:
    """0 unless something failed."""
    return 1 if any(f.status == FAIL for f in findings) else 0
