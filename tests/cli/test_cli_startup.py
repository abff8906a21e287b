"""The command line starts fast because it imports only what a command needs, and it
completes in the shell (click's completion)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, python_env

# What the daemon needs and a CLI call does not: each costs tens to hundreds of ms.
DAEMON_ONLY = ("aiohttp", "zmq", "multiprocess", "mcp", "prometheus_client", "loguru", "asyncio")
DATABASE = ("peewee", "psycopg2", "pymysql")


def imported(tmp_path: Path, *args: str) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """The top-level packages `turnkeeper ARGS` imports, from `python -X importtime`."""
    config = tmp_path / "turnkeeper.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nruntime_dir = "{tmp_path / "run"}"\n'
        f'[http]\nlisten = "unix:{tmp_path / "api.sock"}"\n'
    )
    done = subprocess.run(
        [PYTHON, "-X", "importtime", "-m", "supervisor", "--config", str(config), *args],
        cwd=REPO,
        env=python_env(TURNKEEPER_TOKEN="not-used"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)$", done.stderr, re.M)
    assert names, done.stderr[-2000:]
    return {name.split(".")[0] for name in names}, done


@pytest.mark.parametrize("command", [["status"], ["send", "0" * 32, "hi"], ["--help"]])
def test_a_command_that_talks_to_the_daemon_imports_neither_daemon_nor_database(
    tmp_path: Path, command: list[str]
) -> None:
    packages, done = imported(tmp_path, *command)
    if command != ["--help"]:
        assert done.returncode == 3, done.stderr  # no daemon: it did try to talk to one
    assert packages.isdisjoint(DAEMON_ONLY + DATABASE), packages & set(DAEMON_ONLY + DATABASE)


def complete(**variables: str) -> subprocess.CompletedProcess[str]:
    """The CLI as the shell's completion runs it (`_TURNKEEPER_COMPLETE` and friends)."""
    return subprocess.run(
        [PYTHON, "-c", "from supervisor.cli.main import main; main(prog_name='turnkeeper')"],
        cwd=REPO,
        env={**python_env(), **variables},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_scripts_come_from_click(shell: str) -> None:
    done = complete(_TURNKEEPER_COMPLETE=f"{shell}_source")
    assert done.returncode == 0, done.stderr
    assert "_TURNKEEPER_COMPLETE" in done.stdout


def test_completion_offers_the_commands() -> None:
    done = complete(
        _TURNKEEPER_COMPLETE="bash_complete", COMP_WORDS="turnkeeper sess", COMP_CWORD="1"
    )
    assert done.returncode == 0, done.stderr
    assert "plain,sessions" in done.stdout.splitlines(), done.stdout
