"""The command line's search for the daemon, in process: the places in their order, a
published file trusted only when its pid holds the lock, a place it may not read, the
warning for a broken file, and the process titles read from a /proc of the test's."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from supervisor import locks
from supervisor.cli import discovery
from supervisor.cli.common import broken_file_warning
from supervisor.contract import published, titles
from supervisor.contract.config import ConfigError, load_config
from supervisor.contract.paths import SERVICE_RUNTIME_DIR, SERVICE_STATE_DIR
from supervisor.contract.sections import Config


def said(state: Path, run: Path, pid: int, listen: str = "unix:/x/api.sock") -> None:
    state.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    published.publish(
        published.Published(pid, "b" * 32, "1.0", "h", listen, str(state), str(run), None)
    )


def test_a_place_the_configuration_names_is_the_only_one_looked_in(tmp_path: Path) -> None:
    named = Config.model_validate({"daemon": {"state_dir": str(tmp_path / "s")}})
    (only,) = discovery.places(named, {"HOME": str(tmp_path)})
    assert only.state_dir == tmp_path / "s" and not only.service
    (unit,) = discovery.places(Config(), {"STATE_DIRECTORY": "/srv/tk", "HOME": "/h"})
    assert unit.state_dir == Path("/srv/tk")


def test_else_the_services_directories_then_the_users() -> None:
    env = {"HOME": "/home/ann", "XDG_RUNTIME_DIR": "/run/user/1000"}
    service, user = discovery.places(Config(), env)
    assert (service.state_dir, service.runtime_dir, service.service) == (
        SERVICE_STATE_DIR,
        SERVICE_RUNTIME_DIR,
        True,
    )
    assert (user.state_dir, user.runtime_dir) == (
        Path("/home/ann/.local/state/turnkeeper"),
        Path("/run/user/1000/turnkeeper"),
    )


def test_a_published_file_counts_only_for_the_pid_that_holds_the_lock(tmp_path: Path) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    place = discovery.Place(state, run, "127.0.0.1:9")
    said(state, run, os.getpid(), "unix:/here.sock")
    assert discovery.search([place]).running is None  # nobody holds the lock: left behind

    fd = locks.acquire(state / locks.LEADER_LOCK)  # this process is the daemon now
    try:
        found = discovery.search([place]).running
        assert found is not None and (found.pid, found.listen) == (os.getpid(), "unix:/here.sock")
        said(state, run, os.getpid() + 1)  # an earlier daemon's file, its pid reused
        found = discovery.search([place]).running
        assert found is not None and (found.listen, found.published) == ("127.0.0.1:9", None)
    finally:
        os.close(fd)


def test_withdrawing_leaves_another_daemons_file(tmp_path: Path) -> None:
    state, run = tmp_path / "state", tmp_path / "run"
    said(state, run, 12345)
    published.withdraw(state, run, os.getpid())
    assert published.read(run / published.PUBLISHED).pid == 12345
    said(state, run, os.getpid())
    published.withdraw(state, run, os.getpid())
    assert not list(run.iterdir()) and not list(state.iterdir())


def test_a_place_it_may_not_read_is_not_no_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    denied = tmp_path / "denied"

    def holder(path: Path) -> int | None:
        if path.parent == denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return None

    monkeypatch.setattr(locks, "holder", holder)
    places = [discovery.Place(denied, tmp_path, "x:1"), discovery.Place(tmp_path, tmp_path, "x:1")]
    found = discovery.search(places)
    assert found.running is None
    assert found.unknown == f"permission denied reading {denied / locks.LEADER_LOCK}"


def test_a_broken_file_warns_with_the_line_of_the_key(tmp_path: Path) -> None:
    path = tmp_path / "turnkeeper.toml"
    path.write_text('[daemon]\nstate_dir = "/s"\n\n[pool]\nspare = 1\nworkers = "many"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(str(path), {})
    warning = broken_file_warning(raised.value)
    assert warning.startswith("pool.workers (line 6): ")
    assert warning.endswith("; going on without it, with what the running daemon published")
    assert f"[file {path}]" in warning


def test_a_worker_takes_the_bracket_of_its_supervisors_title(tmp_path: Path) -> None:
    (tmp_path / "40").mkdir()
    (tmp_path / "40" / "cmdline").write_bytes(b"turnkeeper: supervisor [host h /s]\0\0")
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "cmdline").write_bytes(b"turnkeeper: supervisor\0")
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cmdline").write_bytes(b"python\0-m\0http.server\0")
    assert titles.worker_title("w0.1", 40, tmp_path) == "turnkeeper: worker w0.1 [host h /s]"
    assert titles.worker_title("w0.1", 41, tmp_path) == "turnkeeper: worker w0.1"
    assert titles.worker_title("w0.1", 99, tmp_path) == "turnkeeper: worker w0.1"  # gone
    assert sorted(titles.other_supervisors(41, tmp_path)) == [40]
    assert titles.supervisor_title("h", Path("/s"), others=False) == "turnkeeper: supervisor"
