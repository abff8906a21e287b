"""`turnkeeper doctor` checks what `turnkeeper run` checks, the same way (issue 13): for each
kind of configuration `run` refuses, doctor FAILs naming the key, and `run` exits 78 with
one line naming it. Both through the real command line, on a config file in tmp_path."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PYTHON, REPO, python_env
from tests.support import run_turnkeeper

EX_CONFIG = 78


def _module(tmp_path: Path, name: str, body: str) -> None:
    """An agent module `name` in tmp_path/mods (on the PYTHONPATH of every command here)."""
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / f"{name}.py").write_text(body)


def _config(tmp_path: Path, text: str) -> Path:
    config = tmp_path / "turnkeeper.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\nruntime_dir = "{tmp_path / "run"}"\n'
        f'[http]\nlisten = "unix:{tmp_path / "api.sock"}"\n{text}'
    )
    return config


def turnkeeper(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m supervisor --config F ARGS`, with tmp_path/mods importable."""
    environ = python_env(
        TURNKEEPER_CONFIG="",
        PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), str(REPO)]),
        **env,
    )
    return run_turnkeeper(*args, env=environ, config=tmp_path / "turnkeeper.toml", timeout=90)


def doctor_json(tmp_path: Path, **env: str) -> tuple[int, dict[str, Any]]:
    result = turnkeeper(tmp_path, "doctor", "--json", **env)
    return result.returncode, json.loads(result.stdout)


def config_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("turnkeeper: configuration")]


@dataclass(frozen=True)
class Bad:
    """A configuration `run` refuses: the key named, and a fragment of the reason."""

    name: str
    make: Callable[[Path], str]  # tmp_path -> the TOML after [daemon] and [http]
    key: str
    reason: str


def _agent(spec: str, body: str = "") -> Callable[[Path], str]:
    def make(tmp_path: Path) -> str:
        if body:
            _module(tmp_path, spec.partition(":")[0], body)
        return f'[agent]\nclass = "{spec}"\n'

    return make


def _allowed(spec: str) -> Callable[[Path], str]:
    return lambda _: f'[agent]\nallowed = ["workers.agents.tool_loop:ToolLoopAgent", "{spec}"]\n'


def _mcp(command: Callable[[Path], str], extra: str = "") -> Callable[[Path], str]:
    def make(tmp_path: Path) -> str:
        return f'[[mcp.servers]]\nname = "files"\ncommand = ["{command(tmp_path)}"]\n{extra}'

    return make


def _plain_file(tmp_path: Path) -> str:
    path = tmp_path / "mcp-files"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o644)  # not executable, for root too
    return str(path)


def _tokens(content: str | None) -> Callable[[Path], str]:
    def make(tmp_path: Path) -> str:
        path = tmp_path / "tokens"
        if content is not None:
            path.write_text(content)
            path.chmod(0o600)
        return f'[auth]\ntokens_file = "{path}"\n'

    return make


BAD = [
    Bad("agent module missing", _agent("tk_no_such_module:Agent"), "agent.class", "cannot import"),
    Bad(
        "agent import raises",
        _agent("tk_raises:Agent", "raise RuntimeError('no licence key')\n"),
        "agent.class",
        "RuntimeError: no licence key",
    ),
    Bad(
        "agent import exits",
        _agent("tk_exits:Agent", "import sys\nsys.exit(3)\n"),
        "agent.class",
        "SystemExit: 3",
    ),
    Bad(
        "agent import kills its importer",
        _agent("tk_kills:Agent", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"),
        "agent.class",
        "importing it killed the process (SIGKILL)",
    ),
    Bad(
        "agent import ends its process quietly",
        _agent("tk_quits:Agent", "import os\nos._exit(0)\n"),
        "agent.class",
        "importing it ended the process (exit status 0)",
    ),
    Bad(
        "agent class not an agent",
        _agent("tk_plain:Agent", "Agent = 42\n"),
        "agent.class",
        "not a class with an async run_turn",
    ),
    Bad("allowed agent missing", _allowed("tk_gone:Agent"), "agent.allowed[1]", "cannot import"),
    Bad(
        "mcp command not on PATH",
        _mcp(lambda _: "tk-mcp-no-such-command"),
        "mcp.servers.files.command",
        "is not found on the PATH the server gets",
    ),
    Bad(
        "mcp command path missing",
        _mcp(lambda tmp: str(tmp / "nowhere" / "mcp-files")),
        "mcp.servers.files.command",
        "does not exist",
    ),
    Bad(
        "mcp command not executable",
        _mcp(_plain_file),
        "mcp.servers.files.command",
        "is not executable",
    ),
    Bad(
        "task kind's program not on PATH",
        lambda _: '[[tasks.kinds]]\nname = "report"\ncommand = ["tk-no-such-report"]\n',
        "tasks.kinds.report.command",
        "'tk-no-such-report' is not found on the PATH the task gets",
    ),
    Bad(
        "task kind's cwd missing",
        lambda _: '[[tasks.kinds]]\nname = "report"\ncommand = ["sh"]\ncwd = "/nonexistent-tk"\n',
        "tasks.kinds.report.cwd",
        "is not a directory",
    ),
    Bad(
        "mcp cwd missing",
        _mcp(lambda _: "sh", 'cwd = "/nonexistent-tk-dir"\n'),
        "mcp.servers.files.cwd",
        "is not a directory",
    ),
    Bad(
        "model api key variable unset",
        lambda _: '[model]\nprovider = "openai"\nmodel = "m"\napi_key_env = "TK_UNSET_KEY"\n',
        "model.api_key_env",
        "TK_UNSET_KEY, which is not set",
    ),
    Bad("tokens file missing", _tokens(None), "auth.tokens_file", "No such file"),
    Bad("tokens file bad line", _tokens("alice not-a-hash\n"), "auth.tokens_file", "line 1"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_doctor_fails_what_run_refuses(tmp_path: Path, bad: Bad) -> None:
    _config(tmp_path, bad.make(tmp_path))
    code, report = doctor_json(tmp_path)
    assert code == 1, report
    assert report["ok"] is False
    failed = [f for f in report["findings"] if f["status"] == "FAIL"]
    assert [f["check"] for f in failed] == [bad.key], failed
    assert bad.reason in failed[0]["detail"] and failed[0]["fix"], failed[0]
    assert set(failed[0]) == {"status", "check", "detail", "fix"}

    if bad is BAD[0]:  # the text is printed from the same findings: once is enough
        text = turnkeeper(tmp_path, "doctor")
        assert text.returncode == 1
        assert f"FAIL  {bad.key}: " in text.stdout and "      fix: " in text.stdout, text.stdout

    run = turnkeeper(tmp_path, "run")
    assert run.returncode == EX_CONFIG, run.stderr
    [line] = config_errors(run.stderr)
    assert line.startswith(f"turnkeeper: configuration error: {bad.key}"), line
    assert bad.reason in line and "Traceback" not in run.stderr
    assert not (tmp_path / "state" / "turnkeeper.db").exists()  # refused before anything


def test_a_good_configuration_passes_every_check_run_makes(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "started"
    tool = bin_dir / "tk-mcp-tool"
    tool.write_text(f"#!/bin/sh\ntouch {marker}\n")
    tool.chmod(0o755)
    _module(
        tmp_path,
        "tk_side_effect",
        "import os\nfrom workers.agents.tool_loop import "
        "ToolLoopAgent as Agent\nopen(os.environ['TK_MARKER'], 'a').write(f'{os.getpid()}\\n')\n",
    )
    _config(
        tmp_path,
        '[agent]\nclass = "tk_side_effect:Agent"\n'
        # Found only on the PATH the server is given, as the worker would run it.
        '[[mcp.servers]]\nname = "tool"\ncommand = ["tk-mcp-tool"]\n'
        f'env = {{ PATH = "{bin_dir}" }}\n',
    )
    imported = tmp_path / "imported"
    assert turnkeeper(tmp_path, "db", "migrate").returncode == 0
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "supervisor",
            "--config",
            str(tmp_path / "turnkeeper.toml"),
            "doctor",
            "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(
            TURNKEEPER_CONFIG="",
            PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), str(REPO)]),
            TK_MARKER=str(imported),
        ),
    )
    out, _ = proc.communicate(timeout=90)
    report = json.loads(out)
    checks = {f["check"]: f for f in report["findings"]}
    assert proc.returncode == 0 and report["ok"] is True, report
    for key in ("model", "agent.class", "mcp.servers.tool.command", "http.listen"):
        assert checks[key]["status"] == "PASS", checks[key]
    assert checks["mcp.servers.tool.command"]["detail"] == str(tool)
    # The agent module was imported, in another process than doctor's; the server never ran.
    pids = imported.read_text().split()
    assert pids and str(proc.pid) not in pids
    assert not marker.exists()


def test_an_mcp_command_is_looked_up_on_the_servers_path_not_doctors(tmp_path: Path) -> None:
    _config(
        tmp_path,
        f'[[mcp.servers]]\nname = "py"\ncommand = ["{Path(sys.executable).name}"]\n'
        f'env = {{ PATH = "{tmp_path / "empty"}" }}\n',
    )
    code, report = doctor_json(tmp_path)
    [found] = [f for f in report["findings"] if f["check"] == "mcp.servers.py.command"]
    assert code == 1 and found["status"] == "FAIL", found
    assert str(tmp_path / "empty") in found["detail"]


def test_a_configuration_that_does_not_load_is_exit_78_for_doctor_as_for_run(
    tmp_path: Path,
) -> None:
    _config(tmp_path, "[pool]\nworkers = 0\n")
    code, report = doctor_json(tmp_path)
    assert code == EX_CONFIG
    assert report["ok"] is False
    [finding] = report["findings"]
    assert finding["status"] == "FAIL" and finding["check"] == "config"
    assert "pool.workers" in finding["detail"]
    text = turnkeeper(tmp_path, "doctor")
    assert text.returncode == EX_CONFIG and "FAIL  config: pool.workers" in text.stdout
    run = turnkeeper(tmp_path, "run")
    assert run.returncode == EX_CONFIG
    [line] = config_errors(run.stderr)
    assert "pool.workers" in line


def test_an_address_in_use_fails_doctor_and_run_names_it(tmp_path: Path) -> None:
    """Not a configuration error: the address may be free at the next try (exit 1, so the
    service manager restarts), but doctor says so, under the key, as `run` does."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        _config(tmp_path, "")
        code, report = doctor_json(tmp_path, TURNKEEPER_HTTP__LISTEN=listen)
        [found] = [f for f in report["findings"] if f["check"] == "http.listen"]
        assert code == 1 and found["status"] == "FAIL", found
        assert "in use" in found["detail"]
        run = turnkeeper(tmp_path, "run", TURNKEEPER_HTTP__LISTEN=listen)
    assert run.returncode == 1, run.stderr
    [line] = [line for line in run.stderr.splitlines() if f"http.listen {listen}: " in line]
    assert "address already in use" in line.lower()
