"""`turnkeeper doctor`'s look at file descriptors: whether the limit the daemon will get
holds `http.max_connections` beside what the daemon keeps open for the rest.

The daemon raises its soft limit to the hard one at start (`supervisor.contract.fdlimit`),
so the hard limit is what counts: the unit's `LimitNOFILE=` (its hard value) with
`--unit`, else this process's hard limit (what a daemon started from this shell gets), and
the running daemon's own when there is one. Below what `http.max_connections` needs the
daemon still runs, with fewer connections (a WARN); below the floor of connections it is
a FAIL. The judging is `supervisor.core.descriptors`'.
"""

from __future__ import annotations

from pathlib import Path

from supervisor.cli.doctor import FAIL, PASS, WARN, Finding, unit_settings
from supervisor.contract import fdlimit
from supervisor.contract.config import Config
from supervisor.core import descriptors

CHECK = "file descriptors"
SHIPPED_LIMIT = 65536  # the shipped unit's LimitNOFILE=
# systemd's DefaultLimitNOFILE= hard value since v240 (soft 1024); 4096 before.
SYSTEMD_DEFAULT_HARD = 524288


def judge(limit: int, where: str, config: Config) -> Finding:
    """The verdict on a hard limit of `limit` descriptors, named by `where`."""
    reserve = fdlimit.needs(config).reserve()
    configured = config.http.max_connections
    need = descriptors.needed(configured, reserve)
    served = descriptors.cap(configured, limit, reserve)
    if not served.clamped and not served.starved:
        return Finding(
            PASS,
            CHECK,
            f"{where}: {limit} holds http.max_connections ({configured}) and the {reserve} "
            "the daemon keeps for its pool, database, tasks and deliveries",
        )
    if served.starved:
        return Finding(
            FAIL,
            CHECK,
            f"{where}: {limit} is below the {reserve} the daemon keeps for its pool, database, "
            f"tasks and deliveries, with room for {descriptors.MIN_CONNECTIONS} connections",
            f"raise it to at least {need} (LimitNOFILE={SHIPPED_LIMIT} in the unit, as shipped)",
        )
    return Finding(
        WARN,
        CHECK,
        f"{where}: {limit} holds {served.effective} connections beside the {reserve} the "
        f"daemon keeps: http.max_connections ({configured}) will be clamped to "
        f"{served.effective}",
        f"raise it to at least {need} (LimitNOFILE={SHIPPED_LIMIT} in the unit, as shipped), "
        f"or set http.max_connections = {served.effective}",
    )


def parse_limit(raw: str) -> int:
    """The hard value of a `LimitNOFILE=` ("65536", "1024:524288", "infinity"); ValueError
    when it is none of those."""
    hard = raw.strip().rpartition(":")[2].strip()
    if hard == "infinity":
        return 1 << 20  # Linux's nr_open by default: the most a hard limit can be
    if not hard.isdigit():
        raise ValueError(f"not a number of files: {raw!r}")
    return int(hard)


def check_unit(text: str, name: str, config: Config) -> Finding:
    """The unit's `LimitNOFILE=` against what the configuration needs."""
    raw = unit_settings(text).get("LimitNOFILE")
    if raw is None:
        return Finding(
            WARN,
            CHECK,
            f"{name}: no LimitNOFILE=: the daemon gets systemd's DefaultLimitNOFILE (hard "
            f"{SYSTEMD_DEFAULT_HARD} since systemd 240, 4096 before)",
            f"set LimitNOFILE={SHIPPED_LIMIT}",
        )
    try:
        limit = parse_limit(raw)
    except ValueError:
        return Finding(
            FAIL,
            CHECK,
            f"{name}: LimitNOFILE={raw} is not a number of files",
            f"write it as a number, e.g. LimitNOFILE={SHIPPED_LIMIT}",
        )
    return judge(limit, f"{name}: LimitNOFILE={raw}", config)


def running_limit(pid: int) -> int | None:
    """The soft limit of the running daemon `pid` (what it raised it to), if readable."""
    try:
        text = Path(f"/proc/{pid}/limits").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return int(soft) if soft.isdigit() else 1 << 20
    return None


def check_descriptors(
    config: Config, unit: tuple[str, str] | None, running: int | None
) -> list[Finding]:
    """The findings: the unit's limit (`unit`: its text and name) or this process's hard
    limit, and the running daemon's limit if it runs."""
    findings = []
    if unit is not None:
        findings.append(check_unit(unit[0], unit[1], config))
    else:
        _, hard = fdlimit.current()
        findings.append(judge(hard, "the hard limit here (ulimit -Hn)", config))
    if running is not None and (limit := running_limit(running)) is not None:
        findings.append(judge(limit, f"the running daemon's (pid {running}) limit", config))
    return findings
