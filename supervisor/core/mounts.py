"""Which mount a path is on, and whether what is written there survives a stop or a reboot.

Pure code: no file is read. The caller passes the text of `/proc/self/mountinfo` and an
absolute path with its symbolic links resolved; `run` warns and `doctor` fails on what
`volatile` says.

Rules
-----
- A path is on the mount whose mount point is the longest one that is the path itself or
  one of its parents; of two mounts on one point, the later line (mounted on top) wins.
- On `tmpfs`, `ramfs` or `devtmpfs` (memory): lost at every reboot.
- On a mount whose root is a `systemd-private-*` directory: the `/tmp` or `/var/tmp` that
  systemd's `PrivateTmp=yes` gives the service for one run. It is removed when the
  service stops, so the files are lost at every stop, a restart included.
- Under `/tmp` or `/var/tmp` when the caller knows the service runs with `PrivateTmp=yes`
  (`doctor --unit FILE`, which reads the unit from outside the service's namespace): the
  same, whatever the mount.
- Anything else: durable, as far as the mount table can tell.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs"})
PRIVATE_TMP_ROOT = "/systemd-private-"  # in the root of PrivateTmp's bind mounts
TEMPORARY_DIRS = (PurePosixPath("/tmp"), PurePosixPath("/var/tmp"))
_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, \ as \ooo


@dataclass(frozen=True)
class Mount:
    """One line of the mount table, as much of it as the rules need."""

    point: PurePosixPath  # where it is mounted
    root: str  # the directory of its filesystem mounted there ("/" for the whole)
    fstype: str
    source: str


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a `/proc/self/mountinfo` text, in its order; malformed lines skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            separator = fields.index("-", 6)
            root, point = fields[3], fields[4]
            fstype, source = fields[separator + 1], fields[separator + 2]
        except (ValueError, IndexError):
            continue
        mounts.append(Mount(PurePosixPath(_unescape(point)), _unescape(root), fstype, source))
    return mounts


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda match: chr(int(match[1], 8)), field)


def mount_of(path: PurePosixPath, mounts: Iterable[Mount]) -> Mount | None:
    """The mount `path` (absolute, resolved) is on; None if no mount point covers it."""
    found: Mount | None = None
    for mount in mounts:
        covers = mount.point == path or mount.point in path.parents
        if covers and (found is None or len(mount.point.parts) >= len(found.point.parts)):
            found = mount
    return found


def volatile(path: PurePosixPath, mounts: Iterable[Mount], private_tmp: bool = False) -> str | None:
    """Why what is written at `path` will not survive, or None (see the rules above).

    `private_tmp`: the service is known to run with systemd's `PrivateTmp=yes`.
    """
    mount = mount_of(path, mounts)
    if mount is not None and mount.fstype in MEMORY_FILESYSTEMS:
        return (
            f"is on {mount.fstype} (memory, mounted at {mount.point}): it is lost at every reboot"
        )
    under_tmp = next((d for d in TEMPORARY_DIRS if d == path or d in path.parents), None)
    private = mount is not None and PRIVATE_TMP_ROOT in mount.root
    if private or (private_tmp and under_tmp is not None):
        where = under_tmp if under_tmp is not None else mount.point if mount else path
        return (
            f"is under {where}, which systemd's PrivateTmp=yes gives the service for one run: "
            "it is removed at every stop, a restart included"
        )
    return None
