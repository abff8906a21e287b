"""`turnkeeper doctor` and the teardown budget: pure checks, and the command as run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from supervisor.cli.doctor import (
    FAIL,
    PASS,
    WARN,
    check_shipped_stop_timeout,
    check_sqlite,
    check_supervisord,
    check_unit,
    parse_timespan,
)
from supervisor.contract.config import Config
from supervisor.store import Store
from supervisor.teardown import SHIPPED_STOP_TIMEOUT, check_stop_timeout, teardown_budget
from tests.conftest import PYTHON, REPO, python_env, this_host_id

UNIT = (REPO / "systemd" / "turnkeeper.service").read_text()
SUPERVISORD = (REPO / "etc" / "supervisord" / "turnkeeper.conf").read_text()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30),
        ("30s", 30),
        ("1min 30s", 90),
        ("2m", 120),
        ("500ms", 0.5),
        ("1h", 3600),
        ("infinity", float("inf")),
    ],
)
def test_timespans(text: str, seconds: float) -> None:
    assert parse_timespan(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "30 parsecs", "s30"])
def test_bad_timespans(text: str) -> None:
    with pytest.raises(ValueError):
        parse_timespan(text)


def test_a_stop_timeout_under_the_budget_names_every_setting_to_lower() -> None:
    budget = teardown_budget(Config.model_validate({"shutdown": {"subagent_drain": 20}}))
    assert budget.total == 46.5
    problem = check_stop_timeout(budget, 45, "TimeoutStopSec")
    assert problem is not None and "is 45 s, not above the teardown budget of 46.5 s" in problem
    assert "raise it to at least 51 s" in problem
    assert "shutdown.subagent_drain" in problem and "shutdown.kill_grace" in problem
    assert check_stop_timeout(budget, 47, "TimeoutStopSec") is None


def verdicts(findings: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {f.check: f.status for f in findings}


def test_the_shipped_unit_and_supervisord_file_pass() -> None:
    budget = teardown_budget(Config())
    assert set(verdicts(check_unit(UNIT, "unit", budget)).values()) == {PASS}
    assert set(verdicts(check_supervisord(SUPERVISORD, "conf", budget)).values()) == {PASS}


def test_a_short_stop_timeout_and_the_wrong_kill_mode_fail() -> None:
    bad = UNIT.replace("TimeoutStopSec=45", "TimeoutStopSec=10").replace(
        "KillMode=mixed", "KillMode=control-group"
    )
    found = verdicts(check_unit(bad, "unit", teardown_budget(Config())))
    assert found["stop timeout"] == FAIL and found["KillMode"] == FAIL


def test_a_unit_without_timeout_uses_systemds_default() -> None:
    unit = UNIT.replace("TimeoutStopSec=45\n", "")
    assert verdicts(check_unit(unit, "u", teardown_budget(Config())))["stop timeout"] == PASS
    drained = teardown_budget(Config(), drain=60)
    assert verdicts(check_unit(unit, "u", drained))["stop timeout"] == FAIL


def test_supervisord_checks() -> None:
    budget = teardown_budget(Config())
    short = SUPERVISORD.replace("stopwaitsecs=45", "stopwaitsecs=30")
    assert verdicts(check_supervisord(short, "c", budget))["stop timeout"] == FAIL
    default = SUPERVISORD.replace("stopwaitsecs=45\n", "")  # supervisord's default is 10
    assert verdicts(check_supervisord(default, "c", budget))["stop timeout"] == FAIL
    kill = SUPERVISORD.replace("stopsignal=TERM", "stopsignal=KILL")
    assert verdicts(check_supervisord(kill, "c", budget))["stopsignal"] == FAIL
    group = SUPERVISORD.replace("killasgroup=false", "killasgroup=true")
    assert verdicts(check_supervisord(group, "c", budget))["process group"] == WARN
    assert verdicts(check_supervisord("[x]\na=1\n", "c", budget))["supervisord"] == FAIL


def test_without_a_file_the_budget_is_held_to_the_shipped_stop_timeout() -> None:
    found = check_shipped_stop_timeout(teardown_budget(Config()))
    assert found.status == PASS
    assert found.detail.startswith("the teardown budget of 31.5 s is below the shipped")
    # Over it: a warning (the installed file may say otherwise) naming both numbers.
    drained = teardown_budget(Config.model_validate({"shutdown": {"drain_budget": 20}}))
    found = check_shipped_stop_timeout(drained)
    assert found.status == WARN
    assert found.detail.startswith(
        f"the shipped stop timeout (TimeoutStopSec, stopwaitsecs) is {SHIPPED_STOP_TIMEOUT:g} s,"
        " not above the teardown budget of 51.5 s: raise it to at least 56 s, or lower "
        "shutdown.drain_budget, "
    )
    assert "--unit or --supervisord" in found.fix


def test_sqlite_durability_verdicts() -> None:
    assert verdicts(check_sqlite("wal", 2)) == {"journal mode": PASS, "synchronous": PASS}
    assert verdicts(check_sqlite("wal", 1))["synchronous"] == WARN
    assert verdicts(check_sqlite("delete", 0)) == {"journal mode": FAIL, "synchronous": FAIL}


def doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "supervisor", "doctor", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=python_env(
            TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "state"),
            TURNKEEPER_CONFIG="",
            # Not the default port, which another test's daemon may hold (doctor FAILs that).
            TURNKEEPER_HTTP__LISTEN=f"unix:{tmp_path / 'api.sock'}",
        ),
        timeout=60,
    )


def test_doctor_passes_the_shipped_files_on_a_migrated_state_dir(tmp_path: Path) -> None:
    subprocess.run(
        [PYTHON, "-m", "supervisor", "db", "migrate"],
        cwd=REPO,
        check=True,
        env=python_env(TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "state"), TURNKEEPER_CONFIG=""),
        capture_output=True,
    )
    result = doctor(
        tmp_path,
        "--unit",
        str(REPO / "systemd" / "turnkeeper.service"),
        "--supervisord",
        str(REPO / "etc" / "supervisord" / "turnkeeper.conf"),
    )
    # Every check passes but one: this test's state directory is under /tmp, which the
    # shipped unit's PrivateTmp=yes would give the service for one run only.
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and "storage: state directory" in failed[0], result.stdout
    assert result.returncode == 1 and "KillMode=mixed" in result.stdout
    if on_memory(tmp_path):
        return  # a /tmp on tmpfs fails for that: the rest is for a /tmp on disk
    assert "is under /tmp, which systemd's PrivateTmp=yes" in failed[0], result.stdout
    # Without the unit, /tmp on disk is not the service's private one: nothing fails.
    result = doctor(
        tmp_path, "--supervisord", str(REPO / "etc" / "supervisord" / "turnkeeper.conf")
    )
    assert result.returncode == 0 and "FAIL" not in result.stdout, result.stdout


def on_memory(path: Path) -> bool:
    """Whether `path` is on tmpfs or the like, by this machine's mount table."""
    from pathlib import PurePosixPath

    from supervisor.core.mounts import parse_mountinfo, volatile

    table = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return volatile(PurePosixPath(path.resolve()), table) is not None


def test_doctor_flags_a_bad_unit_and_exits_1(tmp_path: Path) -> None:
    unit = tmp_path / "bad.service"
    unit.write_text(
        UNIT.replace("TimeoutStopSec=45", "TimeoutStopSec=30").replace(
            "KillMode=mixed", "KillMode=control-group"
        )
    )
    result = doctor(tmp_path, "--unit", str(unit))
    assert result.returncode == 1
    assert "FAIL  stop timeout" in result.stdout and "FAIL  KillMode" in result.stdout
    assert "fix: set KillMode=mixed" in result.stdout
    # The stop's steps add up to 31.5 s: a unit's 30 s is too short.
    assert "TimeoutStopSec is 30 s, not above the teardown budget of 31.5 s" in result.stdout
    assert "shutdown.subagent_drain" in result.stdout


def test_doctor_and_breaker_status_show_a_tripped_breaker_and_reset_clears_it(
    tmp_path: Path,
) -> None:
    env = python_env(TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "state"), TURNKEEPER_CONFIG="")
    subprocess.run(
        [PYTHON, "-m", "supervisor", "db", "migrate"],
        cwd=REPO,
        check=True,
        env=env,
        capture_output=True,
    )
    with Store(f"sqlite:///{tmp_path / 'state' / 'turnkeeper.db'}", migrate=False) as store:
        for _ in range(3):  # three boots of this host that died (never ended)
            store.boots.begin(this_host_id(), 999_999_999, "test")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "supervisor", *args], cwd=REPO, env=env, capture_output=True, text=True
        )

    result = doctor(tmp_path)
    assert result.returncode == 0, result.stdout  # a warning, not a failure
    assert "PASS  stop timeout: the teardown budget of 31.5 s is below" in result.stdout
    assert "WARN  breaker" in result.stdout and "3 unclean boots" in result.stdout
    assert "turnkeeper breaker reset" in result.stdout
    assert run("breaker", "status").stdout.startswith("TRIPPED: 3 unclean boots")
    reset = run("breaker", "reset")
    assert reset.returncode == 0 and "breaker reset for host" in reset.stdout, reset.stderr
    assert run("breaker", "status").stdout.startswith("clear: 0 unclean boots")
    assert "PASS  breaker" in doctor(tmp_path).stdout
