"""`turnkeeper config show`: the values in use, where each came from, JSON, warnings for
environment variables that look like configuration, and the checks `run` makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.contract.config import config_keys
from supervisor.contract.origins import key_lines
from tests.conftest import PYTHON, REPO, python_env, this_host_id

SECRET = "s3cr3t-pw"

# Variables of the caller's environment that would change what is resolved.
_RESOLVING = ("STATE_DIRECTORY", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR", "TURNKEEPER_CONFIG")


def show(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m supervisor config show ARGS` with HOME=`home` and only the given
    resolving variables."""
    environ = python_env(HOME=str(home), **env)
    for name in _RESOLVING:
        if name not in env:
            environ.pop(name, None)
    for name in list(environ):
        if name.upper().startswith("TURNKEEPER_") and name not in env:
            environ.pop(name)  # the suite's own TURNKEEPER_TEST_* are tested below, on purpose
    return subprocess.run(
        [PYTHON, "-m", "supervisor", "config", "show", *args],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "turnkeeper.toml"
    path.write_text(text)
    return path


def warnings(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("# WARNING:")]


def test_variables_that_look_like_configuration_are_warned_about_once(tmp_path: Path) -> None:
    result = show(
        tmp_path,
        TURNKEEPER_HTTP_LISTEN="127.0.0.1:9999",  # one underscore
        turnkeeper_pool__workers="4",  # lowercase
        TURNKEEPER_POLL_WORKERS="4",  # a misspelt section, one underscore
        TURNKEEPER_WORKERS="4",  # no section
        TURNKEEPER_TOKEN="tk-not-configuration",  # the CLI's, not configuration
        TURNKEEPER_TEST_ANYTHING="1",  # the test suite's
    )
    assert result.returncode == 0, result.stderr
    found = warnings(result.stdout)
    assert sorted(found) == sorted(
        [
            "# WARNING: TURNKEEPER_HTTP_LISTEN is not a configuration variable and is ignored;"
            " did you mean TURNKEEPER_HTTP__LISTEN?",
            "# WARNING: turnkeeper_pool__workers is not a configuration variable and is ignored;"
            " did you mean TURNKEEPER_POOL__WORKERS?",
            "# WARNING: TURNKEEPER_POLL_WORKERS is not a configuration variable and is ignored;"
            " did you mean TURNKEEPER_POOL__WORKERS?",
            "# WARNING: TURNKEEPER_WORKERS is not a configuration variable and is ignored;"
            " did you mean TURNKEEPER_POOL__WORKERS?",
        ]
    ), result.stdout
    # Ignored indeed: the values in use are the defaults.
    assert 'listen = "127.0.0.1:8765"' in result.stdout
    assert "workers = 2" in result.stdout


def test_a_clean_environment_has_no_warning(tmp_path: Path) -> None:
    result = show(tmp_path, TURNKEEPER_POOL__WORKERS="4")
    assert result.returncode == 0, result.stderr
    assert "workers = 4" in result.stdout
    assert warnings(result.stdout) == []


def test_the_teardown_budget_shows_every_step_of_a_stop(tmp_path: Path) -> None:
    result = show(tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    start = lines.index(
        "# teardown budget (each step of a stop at its cap, in order; the worst case):"
    )
    assert lines[start + 1 :] == [
        "#   http listener: 6 s (attach.shutdown_timeout + 1)",
        "#   courier: 1 s (deliveries in flight given back)",
        "#   task starts: 5 s (runners being started)",
        "#   subagent check: 2 s (subagent turns in flight read)",
        "#   subagent drain: 6 s (shutdown.subagent_drain + 1)",
        "#   descendants: 4.5 s (shutdown.kill_grace + 1.5 to reap)",
        "#   peer deregistration: 2 s",
        "#   boot row: 5 s",
        "#   total: 31.5 s",
    ]
    # A drain that takes the budget to the shipped stop timeout is warned about.
    longer = show(tmp_path, "--json", TURNKEEPER_SHUTDOWN__DRAIN_BUDGET="14")
    assert longer.returncode == 0, longer.stderr
    shown = json.loads(longer.stdout)
    assert shown["teardown_budget"] == 45.5
    assert shown["teardown_steps"][0] == {
        "step": "drain",
        "seconds": 14.0,
        "setting": "shutdown.drain_budget",
    }
    assert shown["teardown_steps"][2] == {"step": "courier", "seconds": 1.0, "setting": None}
    assert sum(step["seconds"] for step in shown["teardown_steps"]) == 45.5
    [warning] = shown["warnings"]
    assert warning.startswith(
        "the shipped stop timeout (TimeoutStopSec, stopwaitsecs) is 45 s, not above the "
        "teardown budget of 45.5 s"
    )
    assert "shutdown.drain_budget" in warning


def test_a_misspelt_key_in_the_variable_form_is_an_error_naming_the_nearest(
    tmp_path: Path,
) -> None:
    result = show(tmp_path, TURNKEEPER_POOL__WORKRS="4")
    assert result.returncode == 78
    assert result.stderr.strip() == (
        "turnkeeper: configuration error: TURNKEEPER_POOL__WORKRS: unknown key pool.workrs;"
        " did you mean TURNKEEPER_POOL__WORKERS?"
    )


def test_values_in_use_are_shown_resolved_and_masked(tmp_path: Path) -> None:
    result = show(tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    state = tmp_path / ".local" / "state" / "turnkeeper"
    assert shown["file"] is None
    assert shown["config"]["daemon"] == {
        "state_dir": str(state),
        "runtime_dir": str(state / "run"),
        "host_id": this_host_id(),
    }
    assert shown["config"]["store"]["url"] == f"sqlite:///{state / 'turnkeeper.db'}"

    systemd = show(
        tmp_path,
        "--json",
        STATE_DIRECTORY=str(tmp_path / "lib"),
        XDG_RUNTIME_DIR=str(tmp_path / "xdg"),
        TURNKEEPER_STORE__URL=f"postgresql://tk:{SECRET}@db.internal:5432/tk",
    )
    assert systemd.returncode == 0, systemd.stderr
    daemon = json.loads(systemd.stdout)["config"]
    assert daemon["daemon"]["state_dir"] == str(tmp_path / "lib")
    assert daemon["daemon"]["runtime_dir"] == str(tmp_path / "xdg" / "turnkeeper")
    assert daemon["store"]["url"] == "postgresql://tk:***@db.internal:5432/tk"
    assert SECRET not in systemd.stdout

    text = show(tmp_path, STATE_DIRECTORY=str(tmp_path / "lib"))
    assert f'state_dir = "{tmp_path / "lib"}"' in text.stdout
    assert 'state_dir = ""' not in text.stdout and 'url = ""' not in text.stdout


def test_origins_name_the_default_the_file_line_and_the_variable(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "# comment\n"
        "[pool]\n"
        "spare = 0\n"
        "workers = 3   # overridden below\n"
        "\n"
        "[store]\n"
        f'url = "postgresql://tk:{SECRET}@db:5432/tk"\n'
        "[[mcp.servers]]\n"
        'name = "py"\n'
        f'command = ["{sys.executable}"]\n',
    )
    env = {
        "TURNKEEPER_CONFIG": str(path),
        "TURNKEEPER_POOL__WORKERS": "5",
        "STATE_DIRECTORY": str(tmp_path / "lib"),
    }
    result = show(tmp_path, "--origin", **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"# from {path}"
    assert "workers = 5  # env:TURNKEEPER_POOL__WORKERS" in lines
    assert f"spare = 0  # file:{path}:3" in lines
    assert f'url = "postgresql://tk:***@db:5432/tk"  # file:{path}:7' in lines
    assert f"[[mcp.servers]]  # file:{path}:8" in lines
    assert f'state_dir = "{tmp_path / "lib"}"  # env:STATE_DIRECTORY' in lines
    assert "heartbeat_interval = 1.0  # default" in lines
    assert SECRET not in result.stdout

    as_json = show(tmp_path, "--origin", "--json", **env)
    assert as_json.returncode == 0, as_json.stderr
    shown = json.loads(as_json.stdout)
    assert shown["file"] == str(path)
    assert shown["origins"]["pool.workers"] == "env:TURNKEEPER_POOL__WORKERS"
    assert shown["origins"]["pool.spare"] == f"file:{path}:3"
    assert shown["origins"]["mcp.servers"] == f"file:{path}:8"
    assert shown["origins"]["lease.stale_after"] == "default"
    every_key = {f"{s}.{k}" for s, keys in config_keys().items() for k in keys}
    assert set(shown["origins"]) == every_key
    assert shown["config"]["pool"]["workers"] == 5
    assert shown["config"]["store"]["url"] == "postgresql://tk:***@db:5432/tk"
    assert SECRET not in as_json.stdout
    assert "origins" not in json.loads(show(tmp_path, "--json", **env).stdout)


def test_shown_configuration_loads_again(tmp_path: Path) -> None:
    result = show(tmp_path, "--origin", TURNKEEPER_RECOVERY__ATTEMPT_DELAYS="[1.0, 2.0]")
    assert result.returncode == 0, result.stderr
    again = show(tmp_path, "--json", TURNKEEPER_CONFIG=str(write(tmp_path, result.stdout)))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["config"]["recovery"]["attempt_delays"] == [1.0, 2.0]


def test_key_lines_find_each_key_in_its_table() -> None:
    text = '[pool]\nworkers = 1\n[agent]\n"class" = "a:B"\n[[mcp.servers]]\nname = "x"\n'
    assert key_lines(text) == {
        ("pool", "workers"): 2,
        ("agent", "class"): 4,
        ("mcp", "servers"): 5,
    }


@pytest.mark.parametrize(
    "setting",
    [
        '[agent]\nclass = "tests.no_such_module:Agent"\n',
        '[[mcp.servers]]\nname = "gone"\ncommand = ["no-such-mcp-server"]\n',
    ],
)
def test_show_refuses_what_run_refuses(tmp_path: Path, setting: str) -> None:
    path = write(tmp_path, setting)
    shown = show(tmp_path, TURNKEEPER_CONFIG=str(path))
    assert shown.returncode == 78
    assert shown.stdout == ""
    line = shown.stderr.strip()
    assert line.startswith("turnkeeper: configuration error: ")
    run = subprocess.run(
        [PYTHON, "-m", "supervisor", "--config", str(path), "run"],
        cwd=REPO,
        env=python_env(HOME=str(tmp_path), TURNKEEPER_DAEMON__STATE_DIR=str(tmp_path / "s")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 78
    assert line in run.stderr
