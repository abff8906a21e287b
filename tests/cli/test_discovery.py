"""How the command line finds the daemon, with real daemons: in the service's directories
with an empty environment, as another user who may not look there, with a broken
configuration file, before any daemon ever started; `send --wait` across a restart; and
the process titles of two daemons on one host."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import tomli_w

from supervisor.store import Store
from tests.cli.test_cli_daemon import Lines, popen, stop
from tests.cli.test_client import new_session, one_line
from tests.conftest import PYTHON, REPO
from tests.daemon import Daemon, daemons, is_worker, turnkeeper, wait_until
from tests.restart_harness import RESTART_CONFIG
from tests.support import free_port

__all__ = ["daemons"]  # the fixture
Daemons = Callable[..., Daemon]
SMALL = {"pool": {"workers": 1, "spare": 0}}
NOBODY = 65534
# The shipped unit's StateDirectory= and RuntimeDirectory=.
SERVICE_STATE_DIR = Path("/var/lib/turnkeeper")
SERVICE_RUNTIME_DIR = Path("/run/turnkeeper")
SERVICE_LOCK = Path(tempfile.gettempdir()) / "turnkeeper-tests-service-directories.lock"


def bare(*args: str) -> subprocess.CompletedProcess[str]:
    """`turnkeeper ARGS` with an empty environment (no HOME, no PATH, no TURNKEEPER_*),
    by the interpreter's absolute path, from the checkout (what `-m` imports)."""
    return subprocess.run(
        [PYTHON, "-m", "supervisor", *args],
        cwd=REPO,
        env={},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )


def as_nobody(*args: str) -> tuple[int, str, str]:
    """`turnkeeper ARGS` as the user and group nobody, with an empty environment: its exit
    code, stdout and stderr.

    A forked child of this process that drops to nobody and runs the command line's own
    `main`: the interpreter may live where nobody may not read it (a home directory), so a
    new process of it could not start. What the command imports on the way is imported
    here first, as root.
    """
    from supervisor.cli import client, discovery, main, service  # noqa: F401

    client.Client("127.0.0.1:1", "warm-up").close()  # httpx's transports, imported now
    psutil.Process().parent()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.dup2(out_write, 1)
            os.dup2(err_write, 2)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ.clear()
            os.chdir("/")
            try:
                main.main(args=list(args), prog_name="turnkeeper")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # the test sees it on stderr
            os.write(2, f"child failed: {exc!r}\n".encode())
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(out_write)
    os.close(err_write)
    # A few lines each: they fit the pipes, so the child never waits on a full one.
    _, status = os.waitpid(pid, 0)
    with os.fdopen(out_read, "rb") as o, os.fdopen(err_read, "rb") as e:
        stdout, stderr = o.read().decode(), e.read().decode()
    return os.waitstatus_to_exitcode(status), stdout, stderr


@contextlib.contextmanager
def service_directories() -> Iterator[None]:
    """/var/lib/turnkeeper and /run/turnkeeper for this test alone, removed after: root
    only, never where they exist already (a real installation), one test at a time."""
    if os.geteuid() != 0:
        pytest.skip("the service's directories can be made by root only")
    with SERVICE_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = [p for p in (SERVICE_STATE_DIR, SERVICE_RUNTIME_DIR) if p.exists()]
        if existing:
            pytest.skip(f"{existing[0]} exists: a real installation is left alone")
        try:
            yield
        finally:
            for path in (SERVICE_STATE_DIR, SERVICE_RUNTIME_DIR):
                shutil.rmtree(path, ignore_errors=True)


def as_the_unit_runs_it(daemon: Daemon) -> Daemon:
    """`daemon` with its directories as the shipped unit sets them (StateDirectory=,
    RuntimeDirectory=) and none in its file, its API on a loopback port of its own."""
    del daemon.config["daemon"]
    daemon.config["http"]["listen"] = f"127.0.0.1:{free_port()}"
    daemon.config_path.write_text(tomli_w.dumps(daemon.config))
    daemon.env = {
        "STATE_DIRECTORY": str(SERVICE_STATE_DIR),
        "RUNTIME_DIRECTORY": str(SERVICE_RUNTIME_DIR),
    }
    daemon.state = SERVICE_STATE_DIR  # where the test's own client reads the token
    return daemon


# --- the service's directories ----------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_service_daemon_is_found_with_an_empty_environment_and_never_denied(
    daemons: Daemons,
) -> None:
    with service_directories():
        daemon = as_the_unit_runs_it(daemons(**SMALL)).start()
        boot = daemon.status()["boot"]["id"]
        published = json.loads((SERVICE_RUNTIME_DIR / "daemon.json").read_text())
        assert (published["pid"], published["boot_id"]) == (daemon.pid, boot)
        assert published["listen"] == daemon.listen

        shown = bare("status")
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"boot {boot}  ready\n"), shown.stdout

        # Another user may not look into the directories (0700): it cannot tell, says
        # which file and what to do, and never says "not running".
        denied = f"permission denied reading {SERVICE_STATE_DIR / 'turnkeeper.lock'}"
        for command in (["status"], ["stop"], ["new"]):
            code, out, err = as_nobody(*command)
            assert code == 4, (command, out, err)
            assert out == ""
            assert one_line(err).startswith(
                f"turnkeeper: cannot tell whether the daemon runs: {denied}: run as the "
                "service user"
            ), (command, err)
            assert "not running" not in err
        assert daemon.ready()  # nobody stopped it

        # doctor, without the unit's environment, checks that daemon's files, not the
        # user's directories.
        doctor = bare("doctor", "--json")
        checked = json.loads(doctor.stdout)["findings"]
        assert any(str(SERVICE_STATE_DIR) in f["detail"] for f in checked), checked
        assert not any("/.local/state/turnkeeper" in f["detail"] for f in checked), checked

        stopped = bare("stop")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == f"stopped (pid {daemon.pid})\n"
        assert daemon.wait(30) == 0
        assert not (SERVICE_RUNTIME_DIR / "daemon.json").exists()

        # Stopped now, in the service's directories: the service starts it, not `run`.
        after = bare("status")
        assert after.returncode == 3, after
        assert one_line(after.stderr) == (
            f"turnkeeper: the daemon is not running (none in {SERVICE_STATE_DIR}, "
            f"{pwd.getpwuid(os.getuid()).pw_dir}/.local/state/turnkeeper); "
            "start it with `systemctl start turnkeeper`"
        )


# --- before any daemon, and with a broken configuration file ----------------------------


def test_status_before_any_daemon_ever_started_exits_3(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "d")  # its file and directories; never started
    shown = turnkeeper(daemon, "status")
    assert shown.returncode == 3, shown
    assert shown.stdout == ""
    assert one_line(shown.stderr) == (
        f"turnkeeper: the daemon is not running (none in {daemon.state}); "
        "start it with `turnkeeper run`"
    )
    # $TURNKEEPER_STATE_DIR and `--state-dir` (which wins) name the place to look in.
    elsewhere, there = tmp_path / "elsewhere", tmp_path / "there"
    for args, env in (
        (["status"], {"TURNKEEPER_STATE_DIR": str(elsewhere)}),
        (["status", "--state-dir", str(there)], {"TURNKEEPER_STATE_DIR": str(elsewhere)}),
    ):
        shown = turnkeeper(daemon, *args, **env)
        assert shown.returncode == 3, shown
        looked = there if "--state-dir" in args else elsewhere
        assert f"(none in {looked});" in one_line(shown.stderr), args


def line_of(path: Path, text: str) -> int:
    return path.read_text().splitlines().index(text) + 1


@pytest.mark.timeout(180)
def test_a_broken_file_is_a_warning_naming_its_line_for_commands_that_talk_to_the_daemon(
    daemons: Daemons,
) -> None:
    daemon = daemons(**SMALL).start()
    boot = daemon.status()["boot"]["id"]
    path = daemon.config_path

    # A value the daemon would refuse: the file still says where the daemon is.
    path.write_text(path.read_text().replace("workers = 1", 'workers = "many"'))
    line = line_of(path, 'workers = "many"')
    shown = turnkeeper(daemon, "status")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"boot {boot}  ready\n")
    warning = one_line(shown.stderr)
    assert warning.startswith(f"turnkeeper: warning: pool.workers (line {line}): "), warning
    assert f"[file {path}]" in warning
    # What needs the file itself still refuses it.
    for command in (["reload"], ["config", "show"], ["doctor"]):
        refused = turnkeeper(daemon, *command)
        assert refused.returncode == 78, (command, refused)
        assert "pool.workers" in refused.stdout + refused.stderr

    # Not even TOML: with `--state-dir`, the daemon is found all the same, and stopped.
    path.write_text("[pool\n" + path.read_text())
    state = ["--state-dir", str(daemon.state)]
    shown = turnkeeper(daemon, "status", *state)
    assert shown.returncode == 0, shown.stderr
    warning = one_line(shown.stderr)
    assert re.match(
        rf"turnkeeper: warning: {re.escape(str(path))}: invalid TOML: .*line 1", warning
    )
    stopped = turnkeeper(daemon, *state, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout == f"stopped (pid {daemon.pid})\n"
    assert daemon.wait(30) == 0


# --- send --wait across a restart -------------------------------------------------------


@pytest.mark.timeout(240)
def test_send_wait_rides_out_a_restart_and_prints_the_reply_once(
    daemons: Daemons, tmp_path: Path
) -> None:
    daemon = daemons(restart=RESTART_CONFIG, **SMALL).start()
    session_id = new_session(daemon)
    gate = tmp_path / "gate"
    boot = daemon.status()["boot"]["id"]
    sent = popen(daemon, "send", session_id, f"/gate {gate} held", "--wait")
    out, err = Lines(sent.stdout), Lines(sent.stderr)
    try:
        assert err.read(1, 30) == ["committed as seq 1"]
        with Store(daemon.url) as store:
            wait_until(lambda: store.sessions.get(session_id).active_turn_id, 30, "the turn")
        # No drain (RESTART_CONFIG): the restart cuts the held turn, the next boot goes on
        # with it, held again by the same gate until the test opens it.
        asked = turnkeeper(daemon, "restart", "--no-wait")
        assert asked.returncode == 0, asked.stderr
        lost = err.read(1, 60)[0]
        assert re.fullmatch(
            rf"turnkeeper: lost the daemon at {re.escape(daemon.listen)} \(.+\); reconnecting",
            lost,
        ), lost
        back = err.read(1, 90)[0]
        assert back.startswith(f"turnkeeper: reconnected to the daemon at {daemon.listen}"), back
        wait_until(lambda: daemon.status()["boot"]["id"] != boot, 60, "the new boot")
        assert sent.poll() is None, "send --wait ended with the old boot"
        gate.touch()
        assert sent.wait(60) == 0, err.rest()
        assert out.rest() == f"echo: /gate {gate} held\n"
        assert err.rest() == ""
    finally:
        stop(sent)


# --- process titles ---------------------------------------------------------------------


def title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline()).strip()  # setproctitle pads it


@pytest.mark.timeout(180)
def test_a_second_daemon_on_the_host_names_its_host_and_state_directory_in_its_titles(
    daemons: Daemons,
) -> None:
    first = daemons(**SMALL).start()
    assert title(first.pid).startswith("turnkeeper: supervisor")
    second = daemons(**SMALL, daemon={"host_id": "second-host"}).start()
    bracket = f"[host second-host {second.state}]"
    assert title(second.pid) == f"turnkeeper: supervisor {bracket}"
    workers = wait_until(second.live_workers, 30, "the second daemon's worker")
    names = wait_until(
        lambda: [t for w in workers if (t := title(w.pid)).startswith("turnkeeper: worker ")],
        30,
        "the worker's title",
    )
    assert all(is_worker(w) for w in workers)
    assert names == [f"turnkeeper: worker w0.1 {bracket}"]
