"""What the start says about what survives it: a state directory on memory (tmpfs) is a
warning of `run` and a FAIL of `doctor`, one on disk is neither; and whether interrupted
turns are continued after a restart (`recovery.auto_continue`), both ways."""

from __future__ import annotations

import json
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import pytest

from supervisor.core.mounts import parse_mountinfo, volatile
from tests.daemon import Daemon, daemons, turnkeeper

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
SHM = Path("/dev/shm")  # tmpfs on Linux


@pytest.fixture
def shm_state() -> Iterator[Path]:
    """A state directory to be, under /dev/shm: removed after the test."""
    if not SHM.is_dir():
        pytest.skip("no /dev/shm on this system")
    path = SHM / f"turnkeeper-test-{uuid.uuid4().hex[:12]}" / "state"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


def on_memory(path: Path) -> bool:
    """Whether `path` is on tmpfs or the like, by this machine's mount table."""
    table = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return volatile(PurePosixPath(path.resolve()), table) is not None


def start_lines(daemon: Daemon) -> list[str]:
    """The log lines of the first run up to the ready line."""
    lines = daemon.log().splitlines()
    return lines[: next(i for i, line in enumerate(lines) if "[daemon] ready" in line)]


def storage_findings(daemon: Daemon) -> tuple[int, list[dict[str, str]]]:
    """`doctor --json`: its exit status and its storage findings."""
    result = turnkeeper(daemon, "doctor", "--json")
    findings = json.loads(result.stdout)["findings"]
    return result.returncode, [f for f in findings if f["check"] == "storage"]


def stop(daemon: Daemon) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log()


@pytest.mark.timeout(120)
def test_a_state_directory_on_tmpfs_is_a_warning_of_run_and_a_fail_of_doctor(
    daemons: Daemons, shm_state: Path
) -> None:
    daemon = daemons(
        daemon={"state_dir": str(shm_state)},
        pool={"workers": 1},
        recovery={"auto_continue": False},
    )
    daemon.state, daemon.url = shm_state, f"sqlite:///{shm_state / 'turnkeeper.db'}"
    daemon.start()
    lines = start_lines(daemon)
    warned = [line for line in lines if "WARNING" in line and str(shm_state) in line]
    assert len(warned) == 1, lines
    assert "state directory" in warned[0] and "is on tmpfs" in warned[0], warned
    assert "lost at every reboot" in warned[0] and "daemon.state_dir" in warned[0], warned
    said = [line for line in lines if "interrupted turns:" in line]
    assert len(said) == 1 and "NOT continued after a restart" in said[0], lines
    assert "recovery.auto_continue = false" in said[0], said

    code, storage = storage_findings(daemon)  # read with the running daemon's mount table
    assert code == 1, storage
    assert [f["status"] for f in storage] == ["FAIL"], storage
    assert str(shm_state) in storage[0]["detail"] and "tmpfs" in storage[0]["detail"]
    assert "daemon.state_dir" in storage[0]["fix"]
    stop(daemon)
    code, storage = storage_findings(daemon)  # and with its own
    assert code == 1 and [f["status"] for f in storage] == ["FAIL"], storage


@pytest.mark.timeout(120)
def test_a_state_directory_on_disk_is_neither_and_turns_are_continued(
    daemons: Daemons,
) -> None:
    daemon = daemons(pool={"workers": 1})
    if on_memory(daemon.state.parent):
        pytest.skip("the test's directory is on tmpfs here, not on disk")
    daemon.start()
    lines = start_lines(daemon)
    assert not [line for line in lines if "WARNING" in line and str(daemon.state) in line]
    said = [line for line in lines if "interrupted turns:" in line]
    assert len(said) == 1, lines
    assert "continued after a restart" in said[0] and "NOT" not in said[0], said
    assert "recovery.auto_continue = true" in said[0], said
    _, storage = storage_findings(daemon)
    assert [f["status"] for f in storage] == ["PASS"], storage
    stop(daemon)
