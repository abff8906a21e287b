"""The shipped deployment files, checked by the real tools: systemd-analyze and supervisord."""

from __future__ import annotations

import configparser
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tomli_w

from supervisor.cli.doctor import unit_settings
from supervisor.contract.config import Config
from supervisor.store import Store
from supervisor.teardown import SHIPPED_STOP_TIMEOUT, teardown_budget
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import wait_until
from tests.support import free_port, plain

UNIT = REPO / "systemd" / "turnkeeper.service"
SANDBOXING = "# --- Sandboxing"
OK_EXPOSURE = 3.0  # systemd-analyze's "OK" ends here; 7.7 was "EXPOSED"
# store.connect_timeout's default: how long a start waits for its database
CONNECT_TIMEOUT = Config().store.connect_timeout
SYSUSERS = REPO / "systemd" / "turnkeeper.sysusers"
PROGRAM = REPO / "etc" / "supervisord" / "turnkeeper.conf"
NOT_INSTALLED = (
    "supervisord/supervisorctl not on PATH: Debian's `supervisor` package is not installed "
    "(apt-get install supervisor; .ci/run installs it). Never `pip install supervisor`: "
    "PyPI's package shares turnkeeper's `supervisor` import name."
)


def test_the_shipped_unit_has_the_settings_restarts_rely_on() -> None:
    service = unit_settings(UNIT.read_text())
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "KillMode": "mixed",
        "TimeoutStopSec": "45",
        "WatchdogSec": "30",
        "Restart": "always",
        "RestartSec": "1",
        "RestartPreventExitStatus": "78",
        "StateDirectory": "turnkeeper",
        "RuntimeDirectory": "turnkeeper",
        "CacheDirectory": "turnkeeper",  # tasks.work_dir: outside the state directory
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
    }
    assert {key: service.get(key) for key in expected} == expected
    assert (
        float(service["TimeoutStopSec"]) == SHIPPED_STOP_TIMEOUT > teardown_budget(Config()).total
    )
    # `systemctl reload` is `turnkeeper reload` of the same installation, which waits and
    # exits 78 for a configuration the daemon refuses, under the start timeout systemd
    # gives ExecReload=.
    start = service["ExecStart"].split()
    reload = service["ExecReload"].split()
    assert start[1:] == ["run"] and reload[:2] == [start[0], "reload"], service["ExecReload"]
    assert float(reload[reload.index("--timeout") + 1]) < float(service["TimeoutStartSec"])
    assert service["LimitNOFILE"] == "65536"
    assert service["ProtectSystem"] == "strict"
    assert service["ProtectHome"] in {"yes", "read-only", "tmpfs"}
    # A start that waits store.connect_timeout for its database before it exits 1 is
    # started again RestartSec later: fewer such starts fit in StartLimitIntervalSec than
    # StartLimitBurst, so a database down for long never leaves the unit failed for good.
    unit = unit_settings(UNIT.read_text(), "Unit")
    each = CONNECT_TIMEOUT + float(service["RestartSec"])
    starts = int(float(unit["StartLimitIntervalSec"]) // each) + 1
    assert starts < int(unit["StartLimitBurst"]), unit
    # A dedicated user, the one the sysusers entry creates.
    assert service.get("User") not in {None, "", "root", "0"}
    assert re.search(rf"^u {re.escape(service['User'])} ", SYSUSERS.read_text(), re.M)


def installed_copy(root: Path) -> Path:
    """The shipped unit with ExecStart= and ExecReload= naming a stand-in for turnkeeper:
    they name where it is installed on a host (/opt/turnkeeper), and `systemd-analyze`
    insists that the binary exists."""
    stand_in = root / "turnkeeper"
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    text, count = re.subn(
        r"^(ExecStart|ExecReload)=\S+", rf"\1={stand_in}", UNIT.read_text(), flags=re.M
    )
    assert count == 2, "the unit has no ExecStart= or no ExecReload= line"
    unit = root / "turnkeeper.service"
    unit.write_text(text)
    return unit


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not on PATH")
def test_systemd_analyze_verifies_the_shipped_unit(tmp_path: Path) -> None:
    # User= is kept: `systemd-analyze verify` does not look users up (that happens when
    # the service starts), so the missing turnkeeper user of this machine is not its concern.
    unit = installed_copy(tmp_path)
    text = unit.read_text()
    result = verify(unit)
    output = result.stdout + result.stderr
    print(output)
    about_the_unit = [line for line in output.splitlines() if "turnkeeper" in line]
    assert result.returncode == 0 and about_the_unit == [], output

    # The check can fail here: a misspelt key is reported.
    unit.write_text(text.replace("KillMode=mixed", "KillMod=mixed"))
    result = verify(unit)
    assert "KillMod" in result.stdout + result.stderr, result.stderr


def exposure(unit: Path) -> float:
    """The overall exposure `systemd-analyze security --offline=yes` rates `unit` at
    (0 is the safest, 10 the most exposed); skips if this systemd cannot rate a file."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": ""},
    )
    output = result.stdout + result.stderr
    if "--offline" in output and ("unrecognized" in output or "Unknown" in output):
        pytest.skip(f"this systemd-analyze has no --offline (systemd 250 or later has): {output}")
    found = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", output)
    assert found, output
    print(f"{unit.name}: {found[1]} {found[2]}")
    return float(found[1])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not on PATH")
def test_systemd_analyze_rates_the_shipped_unit_ok(tmp_path: Path) -> None:
    unit = installed_copy(tmp_path)
    assert exposure(unit) <= OK_EXPOSURE

    # The check can fail: without its sandboxing section the unit is exposed.
    text = unit.read_text()
    unit.write_text(text[: text.index(SANDBOXING)] + text[text.index("[Install]") :])
    assert exposure(unit) > OK_EXPOSURE


def sandboxing() -> list[tuple[str, list[str]]]:
    """Each setting of the unit's sandboxing section, with the comment lines above its
    paragraph (a paragraph: lines with no blank line between them)."""
    text = UNIT.read_text()
    section = text[text.index(SANDBOXING) : text.index("[Install]")]
    found: list[tuple[str, list[str]]] = []
    comments: list[str] = []
    for line in section.splitlines()[1:]:
        if not line.strip():
            comments = []
        elif line.startswith("#"):
            comments.append(line)
        else:
            found.append((line.split("=", 1)[0], list(comments)))
    return found


def test_each_sandboxing_setting_is_explained_in_the_unit_and_the_docs() -> None:
    settings = sandboxing()
    assert len(settings) >= 25, settings
    unexplained = [key for key, comments in settings if not comments]
    assert unexplained == [], f"settings with no comment above them: {unexplained}"
    section = (REPO / "docs" / "how-to" / "systemd.md").read_text()
    missing = sorted({key for key, _ in settings if f"`{key}=" not in section})
    assert missing == [], f"docs/how-to/systemd.md does not name: {missing}"
    # What the unit leaves out on purpose is said too, with why.
    for left_out in ("ProcSubset=", "MemoryDenyWriteExecute=", "PrivateNetwork="):
        assert left_out in UNIT.read_text() and left_out in section, left_out


def test_the_supervisord_program_restarts_like_the_unit() -> None:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(PROGRAM.read_text())
    program = parser["program:turnkeeper"]
    assert program["stopsignal"] == "TERM"
    assert float(program["stopwaitsecs"]) == SHIPPED_STOP_TIMEOUT > teardown_budget(Config()).total
    assert not program.getboolean("stopasgroup") and not program.getboolean("killasgroup")
    # Restart=always with RestartPreventExitStatus=78: restart crashes, never a
    # configuration error, and not a daemon stopped on purpose.
    assert program["autorestart"] == "unexpected"
    assert set(program["exitcodes"].split(",")) == {"0", "78"}
    assert int(program["startsecs"]) > 0
    # supervisord run by systemd cannot open /dev/stdout (a socket, ENXIO).
    assert program.getboolean("redirect_stderr")
    assert not program["stdout_logfile"].startswith("/dev/")


# --- a real supervisord -------------------------------------------------------------


def environment(value: str) -> dict[str, str]:
    """supervisord's `environment=KEY="value",...`."""
    return dict(re.findall(r'(\w+)="([^"]*)"', value))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# One MCP server that ignores SIGTERM, in its own process group: supervisord
# (stopasgroup=false) never signals it, so turnkeeper must stop it.
DAEMON_CONFIG = {
    "pool": {"workers": 1, "spare": 0, "heartbeat_interval": 0.2},
    "agent": {"class": "tests.agents:ChaosAgent"},  # for its `/gate`
    "mcp": {
        "servers": [
            {
                "name": "stubborn",
                "command": [PYTHON, "-m", "tests.mcp_servers.tiny", "--ignore-term"],
                "cwd": str(REPO),
                "start_timeout": 30.0,
            }
        ]
    },
}


def program_section(root: Path, port: int) -> dict[str, str]:
    """The shipped [program:turnkeeper], run from this checkout with its files in `root`."""
    shipped = configparser.ConfigParser(interpolation=None)
    shipped.read_string(PROGRAM.read_text())
    program = dict(shipped["program:turnkeeper"])
    # The shipped user does not exist here, and switching users needs root.
    program.pop("user", None)
    # `python -m supervisor` is `turnkeeper`; from the checkout under test.
    program["command"] = f"{PYTHON} -m supervisor run"
    program["directory"] = str(REPO)
    (root / "turnkeeper.toml").write_text(tomli_w.dumps(DAEMON_CONFIG))
    env = environment(program.get("environment", ""))
    env.update(
        HOME=str(root),
        STATE_DIRECTORY=str(root / "state"),
        CACHE_DIRECTORY=str(root / "cache"),
        TURNKEEPER_CONFIG=str(root / "turnkeeper.toml"),
        TURNKEEPER_HTTP__LISTEN=f"127.0.0.1:{port}",
        PYTHONPATH=str(REPO),
    )
    program["environment"] = ",".join(f'{k}="{v}"' for k, v in env.items())
    # The shipped log file's name, in `root`; a device (/dev/stdout) stays as shipped.
    if not program["stdout_logfile"].startswith("/dev/"):
        program["stdout_logfile"] = str(root / Path(program["stdout_logfile"]).name)
    return program


class Supervisord:
    """A private supervisord in the foreground, with the shipped program in its config."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.state = root / "state"
        self.conf = root / "supervisord.conf"
        socket_path = root / "supervisor.sock"
        assert len(str(socket_path)) < 100, f"unix socket path too long: {socket_path}"
        program = program_section(root, self.port)
        self.stopwaitsecs = float(program["stopwaitsecs"])
        self.log_path = Path(program["stdout_logfile"])
        conf = configparser.ConfigParser(interpolation=None)
        conf["unix_http_server"] = {"file": str(socket_path), "chmod": "0700"}
        conf["supervisord"] = {
            "nodaemon": "true",
            "logfile": str(root / "supervisord.log"),
            "pidfile": str(root / "supervisord.pid"),
            "childlogdir": str(root),
        }
        conf["rpcinterface:supervisor"] = {
            "supervisor.rpcinterface_factory": "supervisor.rpcinterface:make_main_rpcinterface"
        }
        conf["supervisorctl"] = {"serverurl": f"unix://{socket_path}"}
        conf["program:turnkeeper"] = program
        with self.conf.open("w") as f:
            conf.write(f)
        self.proc: subprocess.Popen[bytes] | None = None
        self.journal: socket.socket | None = None
        self.journal_env: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        """Debian's supervisord imports *its* `supervisor`: keep this checkout off its path."""
        keep = ("PATH", "LANG", "LC_ALL", "TZ")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(HOME=str(self.root), **self.journal_env)
        return env

    def start(self) -> None:
        """Start it as systemd starts Debian's: `-n`, stdout and stderr a socket (the
        journal's stream) named by JOURNAL_STREAM, which its programs inherit."""
        self.journal, theirs = socket.socketpair()
        st = os.fstat(theirs.fileno())
        self.journal_env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        self.proc = subprocess.Popen(
            [shutil.which("supervisord") or "supervisord", "-n", "-c", str(self.conf)],
            cwd=self.root,
            env=self.env(),
            stdout=theirs.fileno(),
            stderr=theirs.fileno(),
        )
        theirs.close()

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [shutil.which("supervisorctl") or "supervisorctl", "-c", str(self.conf), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            env=self.env(),
        )

    def ready(self) -> bool:
        with contextlib.suppress(httpx.HTTPError), httpx.Client(transport=plain(), timeout=2) as c:
            return c.get(f"http://127.0.0.1:{self.port}/readyz").status_code == 200
        return False

    def client(self) -> httpx.Client:
        token = (self.state / "admin.token").read_text().strip()
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            transport=plain(),
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        )

    def logs(self) -> str:
        parts = []
        for path in (self.root / "supervisord.log", self.log_path):
            readable = path.parent == self.root and path.exists()
            text = path.read_text(errors="replace") if readable else ""
            parts.append(f"--- {path.name} ---\n{text[-4000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop supervisord (it stops the program), then SIGKILL whatever is left, by pid."""
        if self.proc is None:
            return
        tree: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stopwaitsecs + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if self.journal is not None:
            self.journal.close()


@pytest.fixture
def supervisord(tmp_path: Path) -> Iterator[Supervisord]:
    if shutil.which("supervisord") is None or shutil.which("supervisorctl") is None:
        pytest.skip(NOT_INSTALLED)
    sup = Supervisord(tmp_path)
    sup.start()
    try:
        yield sup
    finally:
        sup.stop()


def session_events(client: httpx.Client, session_id: str, after: int) -> list[dict[str, Any]]:
    response = client.get(f"/v1/sessions/{session_id}/events", params={"after": after})
    response.raise_for_status()
    return list(response.json()["events"])


def wait_ready(sup: Supervisord, what: str) -> None:
    deadline = time.monotonic() + 45
    while not sup.ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after 45 s waiting for {what}\n{sup.logs()}")
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_supervisorctl_stop_and_start_finish_the_turn_in_flight(supervisord: Supervisord) -> None:
    sup = supervisord
    wait_ready(sup, "the daemon under supervisord to be ready")
    gate = sup.root / "gate"  # the turn is held in flight until the daemon was stopped
    with sup.client() as client:
        session_id = client.post("/v1/sessions", json={"title": "deploy"}).json()["id"]
        response = client.post(
            f"/v1/sessions/{session_id}/inject", json={"text": f"/gate {gate} hi"}
        )
        assert response.status_code == 202, response.text
        seq = response.json()["seq"]
        turn_id = wait_until(
            lambda: next(
                (
                    e["turn_id"]
                    for e in session_events(client, session_id, seq)
                    if e["type"] == "turn_started"
                ),
                None,
            ),
            20,
            "the slow turn to start",
        )
    pid = int(sup.ctl("pid", "turnkeeper").stdout.strip())
    assert sup.proc is not None and psutil.Process(pid).ppid() == sup.proc.pid
    tree = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    assert len(tree) >= 3, f"expected the daemon, a worker and an MCP server: {tree}"

    # `turnkeeper stop` would only make supervisord start it again: it refuses, names the
    # command that works, and the daemon goes on.
    program = configparser.ConfigParser(interpolation=None)
    program.read(sup.conf)
    refused = subprocess.run(
        [PYTHON, "-m", "supervisor", "stop"],
        cwd=REPO,
        env={**python_env(), **environment(program["program:turnkeeper"]["environment"])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1, refused
    assert "runs under supervisord" in refused.stderr, refused.stderr
    assert "`supervisorctl stop turnkeeper`" in refused.stderr, refused.stderr
    assert psutil.Process(pid).is_running()

    started = time.monotonic()
    stopped = sup.ctl("stop", "turnkeeper", timeout=sup.stopwaitsecs + 30)
    took = time.monotonic() - started
    print(f"supervisorctl stop: {took:.2f} s")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + sup.logs()
    assert took < sup.stopwaitsecs, f"stop took {took:.2f} s\n{sup.logs()}"
    # The daemon exited by itself, with 0: supervisord did not have to SIGKILL it.
    supervisord_log = (sup.root / "supervisord.log").read_text()
    assert "stopped: turnkeeper (exit status 0)" in supervisord_log, sup.logs()
    leftovers = [p for p in tree if alive(p)]
    assert leftovers == [], f"processes outlived the stop: {leftovers}"
    # The program's log file has plain lines, although supervisord had a JOURNAL_STREAM.
    log = sup.log_path.read_text()
    assert "[daemon] ready:" in log
    assert not re.search(r"^<\d>", log, re.M), "syslog priority prefixes in a file log"
    with Store(f"sqlite:///{sup.state / 'turnkeeper.db'}", migrate=False) as store:
        assert store.boots.recent(1)[0].outcome == "clean"
        in_flight = store.events.read(session_id, after=seq, limit=1000)
        assert "turn_ended" not in [e.type for e in in_flight], "the turn was not in flight"

    gate.touch()
    started = time.monotonic()
    restarted = sup.ctl("start", "turnkeeper")
    print(f"supervisorctl start: {time.monotonic() - started:.2f} s")
    assert restarted.returncode == 0 and "started" in restarted.stdout, restarted.stdout
    wait_ready(sup, "the daemon to be ready again")
    assert int(sup.ctl("pid", "turnkeeper").stdout.strip()) != pid
    with sup.client() as client:

        def completed() -> list[dict[str, Any]]:
            found = session_events(client, session_id, seq)
            done = [e for e in found if e["type"] == "turn_ended"]
            return found if done and done[-1]["payload"].get("outcome") == "completed" else []

        found = wait_until(completed, 30, "the interrupted turn to be finished")
    ends = [(e["turn_id"], e["payload"].get("outcome")) for e in found if e["type"] == "turn_ended"]
    assert ends == [(turn_id, "completed")], found
    replies = [e["payload"].get("text") for e in found if e["type"] == "model_response"]
    assert replies == [f"echo: /gate {gate} hi"], found
