"""The shipped unit's sandbox, made without systemd for a daemon under test.

Where PID 1 is not systemd, `systemd-run -p ...` cannot start the unit; this makes the
restrictions that could keep MCP servers or tasks from working, with the same kernel
mechanisms systemd uses, from the unit file itself:

- `SystemCallFilter=` (with `SystemCallErrorNumber=EPERM`, `SystemCallArchitectures=native`):
  a seccomp filter through libseccomp, as systemd makes it, allowing exactly the calls the
  unit's groups name (`systemd-analyze syscall-filter` expands them), EPERM for the rest;
- `RestrictAddressFamilies=`: `socket()` allowed only for the families the unit names;
- `NoNewPrivileges=yes`, `CapabilityBoundingSet=` (empty): `setpriv`;
- `ProtectSystem=strict` with the unit's own directories writable, and `PrivateTmp=yes`:
  every mount read-only in a private mount namespace (`unshare`), but /proc, /sys, /dev,
  the daemon's root and a /tmp and /var/tmp of its own;
- `UMask=0077`.

Not made: the service user (the daemon runs as uid 0 with no capability at all), the
private /dev, `ProtectHome=yes` (this machine's Python lives under /root), the
`Protect*` settings of /proc and /sys. The launcher, run as
`python -m tests.unit_sandbox ALLOWED -- COMMAND...` under `setpriv`, loads the filter
and executes COMMAND (the same pid).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from supervisor.cli.doctor import unit_settings
from tests.conftest import REPO

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
FAMILIES = {
    "AF_UNIX": socket.AF_UNIX,
    "AF_INET": socket.AF_INET,
    "AF_INET6": socket.AF_INET6,
    "AF_NETLINK": socket.AF_NETLINK,
}

# Run by `sh` in the new mount namespace: /tmp and /var/tmp are empty and the service's
# own (PrivateTmp=; the daemon's root and the checkout the daemon runs from, either of
# which may be under /tmp, are moved into the new ones), the daemon's root stays writable
# (the unit's StateDirectory, CacheDirectory and RuntimeDirectory), every other mount but
# /proc, /sys and /dev becomes read-only (the checkout too, as ProtectSystem=strict makes
# an installation); then no new privileges, no capabilities, and the filter.
MOUNTS = """set -e
root=$1; code=$2; python=$3; allowed=$4; shift 4
mount -t tmpfs tmpfs /mnt  # outside /tmp: it holds both while the new /tmp is mounted
mkdir /mnt/root /mnt/code
mount --bind "$root" /mnt/root
mount --bind "$code" /mnt/code
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=1777 tmpfs /var/tmp
mkdir -p "$root" "$code"
mount --move /mnt/root "$root"
mount --move /mnt/code "$code"
umount /mnt  # what was mounted below it shows again
findmnt -rno TARGET | while read -r target; do
    [ -e "$target" ] || continue  # under the old /tmp (another test's mount): hidden now
    case "$target" in
        /proc|/proc/*|/sys|/sys/*|/dev|/dev/*|/tmp|/var/tmp|"$root") ;;
        *) mount -o remount,bind,ro "$target" || exit 1 ;;
    esac
done
exec setpriv --no-new-privs --bounding-set=-all --inh-caps=-all \\
    "$python" -m tests.unit_sandbox "$allowed" -- "$@"
"""


def expand(group: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of a `SystemCallFilter=` group (or one call's name), recursively."""
    seen = set() if seen is None else seen
    if not group.startswith("@"):
        return {group}
    if group in seen:
        return set()
    seen.add(group)
    listed = subprocess.run(
        ["systemd-analyze", "syscall-filter", "--no-pager", group],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    found: set[str] = set()
    for line in listed.splitlines()[1:]:
        item = line.strip()
        if item and not item.startswith("#"):
            found |= expand(item, seen)
    return found


def unit_filter(unit_text: str) -> tuple[set[str], list[int]]:
    """The system calls the unit allows, and the socket families it allows."""
    lines = [
        value
        for key, value in re.findall(r"^(\w+)=(.*)$", unit_text, re.M)
        if key == "SystemCallFilter"
    ]
    allowed: set[str] = set()
    for value in lines:
        if value.startswith("~"):
            for group in value[1:].split():
                allowed -= expand(group)
        else:
            for group in value.split():
                allowed |= expand(group)
    families = unit_settings(unit_text)["RestrictAddressFamilies"].split()
    return allowed, [FAMILIES[name] for name in families]


def write_allowed(unit_text: str, path: Path) -> Path:
    """The unit's filter, as the launcher reads it: calls, then `socket FAMILY` lines."""
    allowed, families = unit_filter(unit_text)
    lines = sorted(allowed - {"socket"}) + [f"socket {family}" for family in families]
    path.write_text("\n".join(lines) + "\n")
    return path


def launcher(root: Path, allowed: Path, python: str, code: Path = REPO) -> list[str]:
    """The command that starts what follows it inside the unit's sandbox: the daemon's
    `root` writable, the checkout `code` (with its virtualenv) read-only."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        MOUNTS,
        "sh",
        str(root),
        str(code),
        python,
        str(allowed),
    ]


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def load_filter(allowed: Path) -> None:
    """Load the seccomp filter `allowed` describes into this process (and what it runs)."""
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp") or "libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(0x00050000 | errno.EPERM)  # SCMP_ACT_ERRNO(EPERM)
    assert ctx, "seccomp_init failed"
    for line in allowed.read_text().splitlines():
        name, _, family = line.partition(" ")
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # not a call of this architecture
        if family:
            compare = (_ArgCmp * 1)(_ArgCmp(0, SCMP_CMP_EQ, int(family), 0))
            rc = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, number, 1, compare)
        else:
            rc = lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, number, 0, None)
        assert rc == 0, f"seccomp_rule_add {line}: {rc}"
    rc = lib.seccomp_load(ctx)
    assert rc == 0, f"seccomp_load: {rc}"


def main(argv: list[str]) -> None:
    allowed, separator, *command = argv
    assert separator == "--" and command, "usage: ALLOWED -- COMMAND..."
    os.umask(0o077)
    load_filter(Path(allowed))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
