"""Which service manager runs the daemon, so that `stop` does not fight it.

A daemon under systemd's `Restart=always` (the shipped unit) or supervisord's
`autorestart` is started again the moment `turnkeeper stop` makes it exit: the operator
must stop the service instead. The daemon's own environment says who started it
by its parent (systemd or supervisord) and, for systemd, its cgroup names the unit;
supervisord's variables name the program.

`detect` is pure; `inspect` reads the process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

_UNIT = re.compile(r"(?:^|/)([^/\s]+\.service)(?=/|$)")


@dataclass(frozen=True)
class Manager:
    """A service manager and the command that stops the daemon through it."""

    name: str  # "systemd" or "supervisord"
    stop_command: str
    reload_command: str


def detect(environ: Mapping[str, str] | None, cgroup: str = "", parent: str = "") -> Manager | None:
    """The manager of a daemon with this environment, cgroup and parent process name.

    The parent decides: the daemon is the service's main process, started by systemd or
    supervisord itself. Their variables alone are not enough: every process below a
    service inherits them (a CI runner's tests, a terminal started as a user service).
    None when it runs by hand (a shell, a test, `nohup`).
    """
    environ = environ or {}
    if parent == "systemd":
        found = _unit(cgroup)
        if found is None:
            return None
        unit, user = found
        systemctl = "systemctl --user" if user else "systemctl"
        name = unit.removesuffix(".service")
        return Manager("systemd", f"{systemctl} stop {name}", f"{systemctl} reload {name}")
    if parent == "supervisord":
        program = environ.get("SUPERVISOR_PROCESS_NAME", "turnkeeper")
        group = environ.get("SUPERVISOR_GROUP_NAME", program)
        target = program if group == program else f"{group}:{program}"
        return Manager(
            "supervisord", f"supervisorctl stop {target}", f"supervisorctl signal HUP {target}"
        )
    return None


def _unit(cgroup: str) -> tuple[str, bool] | None:
    """The systemd service a process's /proc/PID/cgroup puts it in, and whether it is a
    user's (`systemctl --user`) rather than the system's."""
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        units = _UNIT.findall(path)
        if units:  # the innermost: a user's service sits below its user@UID.service
            return units[-1], "/user@" in path
    return None


def inspect(pid: int) -> Manager | None:
    """The service manager of the running process `pid`, read from /proc via psutil."""
    import psutil

    try:
        process = psutil.Process(pid)
    except psutil.Error:
        return None
    environ: dict[str, str] | None
    try:
        environ = process.environ()
    except psutil.Error:
        environ = None
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as file:
            cgroup = file.read()
    except OSError:
        cgroup = ""
    try:
        parent_process = process.parent()
        parent = parent_process.name() if parent_process is not None else ""
    except psutil.Error:
        parent = ""
    return detect(environ, cgroup, parent)
