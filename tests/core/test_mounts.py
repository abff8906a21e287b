"""Which mount a path is on, and whether it survives: driven with made-up mount tables."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from supervisor.core.mounts import Mount, mount_of, parse_mountinfo, volatile

# A host's table: / on ext4, /dev/shm on tmpfs (mounted twice, the later on top), /var/lib
# on its own disk, a directory with a space, a ramfs, and a service's PrivateTmp=yes /tmp
# and /var/tmp (bind mounts of directories under the host's /tmp and /var/tmp).
TABLE = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=12334760k,mode=755
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683772k
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
30 25 0:27 / /dev/shm rw,relatime shared:5 - xfs /dev/vdc rw
31 27 254:16 / /var/lib rw,relatime shared:7 master:1 - ext4 /dev/vdb rw
32 31 0:40 / /var/lib/my\\040state rw - tmpfs tmpfs rw
33 27 0:41 / /srv/ram rw - ramfs ramfs rw
34 27 254:0 /tmp/systemd-private-0f3c-turnkeeper.service-Ab12/tmp /tmp rw - ext4 /dev/vda rw
35 27 254:0 /var/tmp/systemd-private-0f3c-turnkeeper.service-Cd34/tmp /var/tmp rw - ext4 /dev/vda rw
not a mountinfo line
"""
MOUNTS = parse_mountinfo(TABLE)
P = PurePosixPath


def test_the_table_is_parsed_in_order_with_escapes_and_optional_fields() -> None:
    assert [m.point for m in MOUNTS][:4] == [P("/proc"), P("/dev"), P("/dev/shm"), P("/")]
    assert len(MOUNTS) == 10  # the malformed line is skipped
    assert MOUNTS[5] == Mount(P("/var/lib"), "/", "ext4", "/dev/vdb")
    assert MOUNTS[6].point == P("/var/lib/my state")


@pytest.mark.parametrize(
    ("path", "point", "fstype"),
    [
        ("/var/lib/turnkeeper", "/var/lib", "ext4"),
        ("/var/lib", "/var/lib", "ext4"),
        ("/var/library", "/", "ext4"),  # a prefix of the name is not a parent
        ("/dev/shm/tk", "/dev/shm", "xfs"),  # the later of two mounts on one point
        ("/dev/null", "/dev", "devtmpfs"),
        ("/var/lib/my state/db", "/var/lib/my state", "tmpfs"),
        ("/", "/", "ext4"),
    ],
)
def test_a_path_is_on_the_longest_mount_point_above_it(path: str, point: str, fstype: str) -> None:
    found = mount_of(P(path), MOUNTS)
    assert found is not None and (found.point, found.fstype) == (P(point), fstype)


def test_no_mount_covers_a_path_of_an_empty_table() -> None:
    assert mount_of(P("/var/lib/turnkeeper"), []) is None
    assert volatile(P("/var/lib/turnkeeper"), []) is None


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/var/lib/my state/tk", "is on tmpfs (memory, mounted at /var/lib/my state)"),
        ("/srv/ram/tk/turnkeeper.db", "is on ramfs (memory, mounted at /srv/ram)"),
        ("/dev/tk", "is on devtmpfs"),
        ("/tmp/tk", "is under /tmp, which systemd's PrivateTmp=yes"),
        ("/var/tmp/tk/turnkeeper.db", "is under /var/tmp, which systemd's PrivateTmp=yes"),
    ],
)
def test_memory_and_a_private_tmp_do_not_survive(path: str, said: str) -> None:
    reason = volatile(P(path), MOUNTS)
    assert reason is not None and reason.startswith(said), reason
    assert "reboot" in reason or "every stop" in reason


@pytest.mark.parametrize("path", ["/var/lib/turnkeeper", "/home/tk/.local/state", "/dev/shm/x"])
def test_a_disk_survives(path: str) -> None:
    assert volatile(P(path), MOUNTS) is None
    assert volatile(P(path), MOUNTS, private_tmp=True) is None


def test_tmp_on_disk_survives_unless_the_service_runs_with_private_tmp() -> None:
    """From outside the service (`doctor --unit`), /tmp is the host's: only the unit's
    PrivateTmp=yes says that the service's is another, removed at each stop."""
    host = parse_mountinfo("27 1 254:0 / / rw - ext4 /dev/vda rw\n")
    for path in ("/tmp/tk", "/var/tmp/tk", "/tmp"):
        assert volatile(P(path), host) is None
        reason = volatile(P(path), host, private_tmp=True)
        assert reason is not None and "removed at every stop" in reason
    assert volatile(P("/tmpfiles/tk"), host, private_tmp=True) is None
