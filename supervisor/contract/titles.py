"""The titles of turnkeeper's processes, as `ps`, `top` and `pgrep` show them.

The supervisor is `turnkeeper: supervisor`, its workers `turnkeeper: worker w0.1`. When
another supervisor already runs on the host at start (two services, a test daemon beside
the real one), both titles carry this daemon's host id and state directory, so that an
operator can tell whose worker a process is:

    turnkeeper: supervisor [host 4f2a... /var/lib/turnkeeper]
    turnkeeper: worker w0.1 [host 4f2a... /var/lib/turnkeeper]

Detected once, at start, by reading the other processes' command lines in /proc (a few
milliseconds): a daemon started first keeps its short title until its next start. A
worker takes the bracket from its supervisor's title.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SUPERVISOR = "turnkeeper: supervisor"
PROC = Path("/proc")


def supervisor_title(host_id: str, state_dir: Path, *, others: bool) -> str:
    """The supervisor's title: with its host id and state directory if `others` run."""
    return SUPERVISOR + (f" [host {host_id} {state_dir}]" if others else "")


def worker_title(identity: str, supervisor_pid: int, proc: Path = PROC) -> str:
    """A worker's title: its identity, and the bracket of its supervisor's title."""
    parent = _cmdline(proc / str(supervisor_pid))
    bracket = parent.removeprefix(SUPERVISOR) if parent.startswith(SUPERVISOR) else ""
    return f"turnkeeper: worker {identity}{bracket}"


def other_supervisors(own_pid: int, proc: Path = PROC) -> list[int]:
    """The pids of the other turnkeeper supervisors that run on this host now."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(proc):
            if not entry.name.isdigit() or int(entry.name) == own_pid:
                continue
            if _cmdline(Path(entry.path)).startswith(SUPERVISOR):
                found.append(int(entry.name))
    return found


def _cmdline(process: Path) -> str:
    """A process's title (its command line, NULs as spaces); "" once it is gone."""
    try:
        raw = (process / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()
