"""Secrets and files the daemon trusts, each driven from outside a real daemon: its HTTP
socket, its files, its exit code and log, `turnkeeper doctor` and `config show`."""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from supervisor import trust
from supervisor.http.auth import digest
from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, answer_json, daemons, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]
EX_CONFIG = 78
NOBODY = 65534  # "another user"; the tests run as root
ALICE = "tk-alice-5b1e0c9d7a3f4e2b8c6d0a1f9e7b3c5d"
ME = pwd.getpwuid(os.geteuid()).pw_name
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def _nobody() -> str:
    try:
        return f"{pwd.getpwuid(NOBODY).pw_name} (uid {NOBODY})"
    except KeyError:
        return f"uid {NOBODY}"


OWNED_BY_NOBODY = (
    f"is owned by {_nobody()}, not by {trust.user_name(os.geteuid())}, the user turnkeeper runs as"
)


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    path.chmod(mode)
    return path


def small_daemon(daemons: Daemons, tmp_path: Path, **sections: dict[str, object]) -> Daemon:
    """A daemon with one worker, a unix API socket, and a tokens file in `tmp_path`."""
    return daemons(
        http={"listen": f"unix:{tmp_path / 'api.sock'}"},
        pool={"workers": 1, "spare": 0},
        auth={"tokens_file": str(tmp_path / "tokens")},
        **sections,
    )


def outcome(daemon: Daemon) -> int | None:
    """The exit code of a daemon that stopped at start, or None if it became ready."""
    proc = daemon.proc
    assert proc is not None
    wait_until(lambda: proc.poll() is not None or daemon.ready(), 45, "an exit or readiness")
    return proc.poll()


def run_output(daemon: Daemon) -> list[str]:
    """The lines the latest run wrote."""
    return daemon.log().rsplit(f"--- run {daemon.runs} ---\n", 1)[-1].splitlines()


def status(sock: Path, authorization: bytes | None) -> int:
    """The status of GET /v1/sessions sent byte for byte, with this Authorization value."""
    header = b"" if authorization is None else b"Authorization: " + authorization + b"\r\n"
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(str(sock))
        conn.sendall(
            b"GET /v1/sessions HTTP/1.1\r\nHost: turnkeeper\r\n"
            + header
            + b"Connection: close\r\n\r\n"
        )
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return int(reply.split(b" ", 2)[1])


# --- an empty token never authenticates ------------------------------------------------


@pytest.mark.parametrize("content", ["", "  \n\t\n"], ids=["empty", "whitespace"])
def test_an_empty_admin_token_is_replaced_and_a_bare_bearer_is_refused(
    daemons: Daemons, tmp_path: Path, content: str
) -> None:
    daemon = small_daemon(daemons, tmp_path)
    private_file(tmp_path / "tokens", f"alice sha256:{digest(ALICE)}\n")
    daemon.state.mkdir(mode=0o700)
    token_file = private_file(daemon.state / "admin.token", content)
    daemon.start()
    sock = tmp_path / "api.sock"
    for bare in (b"Bearer", b"Bearer ", b"Bearer    ", b"bearer \t ", b""):
        assert status(sock, bare) == 401, bare
    assert status(sock, None) == 401
    token = token_file.read_text().strip()
    assert len(token) >= 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert not [p.name for p in daemon.state.iterdir() if p.name.startswith(".admin.token")]
    [warning] = [line for line in daemon.log().splitlines() if "WARNING [auth]" in line]
    assert warning.endswith(f"the admin token {token_file} was empty; wrote a fresh one")
    assert status(sock, b"Bearer " + token.encode()) == 200
    assert status(sock, b"Bearer " + ALICE.encode()) == 200


# --- files the daemon trusts -----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A file or directory made untrustworthy; `problem: fix` is the line expected."""

    name: str
    spoil: Callable[[Daemon, Path], tuple[str, str]]  # (daemon, tmp_path) -> (problem, fix)
    doctor: bool = True
    needs_root: bool = False


def _open_state(d: Daemon, _: Path) -> tuple[str, str]:
    d.state.chmod(0o777)
    return f"state directory {d.state} is writable by group or others (0777)", (
        f"chmod 700 {d.state}"
    )


def _foreign_state(d: Daemon, _: Path) -> tuple[str, str]:
    os.chown(d.state, NOBODY, NOBODY)
    return f"state directory {d.state} {OWNED_BY_NOBODY}", f"chown {ME} {d.state}"


def _group_runtime(d: Daemon, _: Path) -> tuple[str, str]:
    run = d.root / "run"
    run.chmod(0o770)
    return f"runtime directory {run} is writable by group or others (0770)", f"chmod 700 {run}"


def _readable_admin_token(d: Daemon, _: Path) -> tuple[str, str]:
    path = private_file(d.state / "admin.token", "tk-admin-readable\n", 0o644)
    return f"admin token {path} is readable by group or others (0644)", f"chmod 600 {path}"


def _linked_admin_token(d: Daemon, tmp: Path) -> tuple[str, str]:
    path = d.state / "admin.token"
    path.symlink_to(private_file(tmp / "somebody-elses-secret", "tk-not-yours\n"))
    return f"admin token {path} is a symbolic link", f"rm {path} (turnkeeper writes a new one)"


def _writable_tokens(d: Daemon, tmp: Path) -> tuple[str, str]:
    path = tmp / "tokens"
    path.chmod(0o666)
    return f"tokens file {path} is writable by group or others (0666)", f"chmod 600 {path}"


def _group_readable_tokens(d: Daemon, tmp: Path) -> tuple[str, str]:
    path = tmp / "tokens"
    path.chmod(0o640)  # only a root-owned one may be, and only for a daemon not run as root
    return f"tokens file {path} is readable by group or others (0640)", f"chmod 600 {path}"


def _foreign_tokens(d: Daemon, tmp: Path) -> tuple[str, str]:
    path = tmp / "tokens"
    os.chown(path, NOBODY, NOBODY)
    return f"tokens file {path} {OWNED_BY_NOBODY}", f"chown {ME} {path}"


def _linked_leader_lock(d: Daemon, tmp: Path) -> tuple[str, str]:
    path = d.state / "turnkeeper.lock"
    path.symlink_to(private_file(tmp / "victim", "precious\n"))
    return f"lock file {path} is a symbolic link", f"rm {path} (turnkeeper writes a new one)"


def _foreign_control_lock(d: Daemon, _: Path) -> tuple[str, str]:
    path = private_file(d.root / "run" / "control.sock.lock", "")
    os.chown(path, NOBODY, NOBODY)
    return f"lock file {path} {OWNED_BY_NOBODY}", f"chown {ME} {path}"


def _writable_database(d: Daemon, _: Path) -> tuple[str, str]:
    path = private_file(d.state / "turnkeeper.db", "", 0o666)
    return f"database file {path} is writable by group or others (0666)", f"chmod 600 {path}"


def _linked_wal(d: Daemon, tmp: Path) -> tuple[str, str]:
    target = private_file(tmp / "victim-wal", "")
    path = d.state / "turnkeeper.db-wal"
    path.symlink_to(target)
    return f"database file {path} is a symbolic link", (
        f"replace the link with the file it points to ({target})"
    )


CASES = [
    Case("state dir writable by others", _open_state),
    # Run as root, doctor judges the files against the state directory's owner (the
    # service's user), so a state directory of another user is that user's to run.
    Case("state dir of another user", _foreign_state, doctor=False, needs_root=True),
    Case("runtime dir writable by its group", _group_runtime),
    Case("admin token readable by others", _readable_admin_token),
    Case("admin token a symlink", _linked_admin_token),
    Case("tokens file 0666", _writable_tokens),
    Case("tokens file readable by its group", _group_readable_tokens),
    Case("tokens file of another user", _foreign_tokens, needs_root=True),
    Case("leader lock a symlink", _linked_leader_lock),
    Case("control lock of another user", _foreign_control_lock, needs_root=True),
    Case("database writable by others", _writable_database),
    Case("database WAL a symlink", _linked_wal),
]


def spoiled(daemons: Daemons, tmp_path: Path, case: Case) -> tuple[Daemon, str, str]:
    """A daemon whose files are all in order except the one `case` spoils."""
    daemon = small_daemon(daemons, tmp_path)
    private_file(tmp_path / "tokens", f"alice sha256:{digest(ALICE)}\n")
    daemon.state.mkdir(mode=0o700)
    (daemon.root / "run").mkdir(mode=0o700)
    problem, fix = case.spoil(daemon, tmp_path)
    return daemon, problem, fix


def params(cases: list[Case]) -> list[object]:
    return [pytest.param(c, id=c.name, marks=[ROOT_ONLY] if c.needs_root else []) for c in cases]


@pytest.mark.parametrize("case", params(CASES))
def test_the_daemon_refuses_a_file_it_cannot_trust(
    daemons: Daemons, tmp_path: Path, case: Case
) -> None:
    daemon, problem, fix = spoiled(daemons, tmp_path, case)
    modes = {p: os.lstat(p).st_mode for p in (daemon.state, daemon.root / "run")}
    daemon.start(wait=False)
    assert outcome(daemon) == EX_CONFIG, daemon.log()
    assert run_output(daemon) == [f"turnkeeper: configuration error: {problem}: {fix}"]
    # Nothing was changed to make it pass, and nothing was written through a link.
    assert {p: os.lstat(p).st_mode for p in modes} == modes
    if (tmp_path / "victim").exists():
        assert (tmp_path / "victim").read_text() == "precious\n"


def _stat(kind: int, mode: int, uid: int) -> os.stat_result:
    return os.stat_result((kind | mode, 1, 1, 1, uid, uid, 0, 0, 0, 0))


@pytest.mark.parametrize(
    ("st", "expect", "verdict"),
    [
        (_stat(stat.S_IFDIR, 0o755, 999), trust.STATE_DIR, None),
        (_stat(stat.S_IFDIR, 0o700, 0), trust.STATE_DIR, None),
        (_stat(stat.S_IFDIR, 0o1777, 0), trust.STATE_DIR, "a directory of its own instead"),
        (_stat(stat.S_IFREG, 0o640, 0), trust.TOKENS_FILE, None),  # root:turnkeeper 0640
        (_stat(stat.S_IFREG, 0o660, 0), trust.TOKENS_FILE, "writable by group or others (0660)"),
        (_stat(stat.S_IFREG, 0o640, 999), trust.TOKENS_FILE, "readable by group or others"),
        (_stat(stat.S_IFREG, 0o644, 0), trust.ADMIN_TOKEN, "readable by group or others"),
        (_stat(stat.S_IFREG, 0o644, 999), trust.LOCK_FILE, None),
        (_stat(stat.S_IFREG, 0o600, 1000), trust.DATABASE, "is owned by"),
        (_stat(stat.S_IFIFO, 0o600, 999), trust.LOCK_FILE, "is not a regular file"),
        (_stat(stat.S_IFREG, 0o600, 999), trust.STATE_DIR, "is not a directory"),
        (_stat(stat.S_IFLNK, 0o777, 999), trust.DATABASE, "is a symbolic link"),
    ],
)
def test_what_a_daemon_running_as_uid_999_trusts(
    st: os.stat_result, expect: trust.Expect, verdict: str | None
) -> None:
    problem = trust.judge(st, Path("/x"), expect, 999)
    if verdict is None:
        assert problem is None
    else:
        assert problem is not None and verdict in str(problem), problem


# --- doctor agrees ---------------------------------------------------------------------

DOCTOR_CASES = [c for c in CASES if c.doctor]


@pytest.mark.parametrize("case", params(DOCTOR_CASES))
def test_doctor_fails_a_file_the_daemon_would_refuse(
    daemons: Daemons, tmp_path: Path, case: Case
) -> None:
    daemon, problem, fix = spoiled(daemons, tmp_path, case)
    result = subprocess.run(
        [PYTHON, "-m", "supervisor", "--config", str(daemon.config_path), "doctor"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"FAIL  files: {problem}\n      fix: {fix}\n" in result.stdout, result.stdout


# --- tokens-file lines that would be ignored -------------------------------------------

BOB = "tk-bob-2f4a6c8e0b1d3f5a7c9e1b3d5f7a9c0e"


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        (
            ["# operators", f"admin sha256:{digest(BOB)}"],
            "line 2: the principal 'admin' is reserved for the admin token "
            "(<state_dir>/admin.token); give this token another name",
        ),
        (
            [f"alice sha256:{digest(ALICE)}", "", f"alice sha256:{digest(BOB)}"],
            "line 3: 'alice' is listed already on line 1; keep one line per principal",
        ),
        (
            [f"alice sha256:{digest(ALICE)}", f"bob sha256:{digest(ALICE)}"],
            "line 2: this is the hash of 'alice' (line 1); give 'bob' a token of its own",
        ),
        (
            [f"carol sha256:{digest('')}"],
            "line 1: this is the hash of an empty token; give 'carol' a token of its own",
        ),
    ],
    ids=["admin", "principal twice", "one hash twice", "empty token"],
)
def test_a_tokens_file_line_that_would_be_ignored_is_a_configuration_error(
    daemons: Daemons, tmp_path: Path, lines: list[str], error: str
) -> None:
    daemon = small_daemon(daemons, tmp_path)
    tokens = private_file(tmp_path / "tokens", "\n".join(lines) + "\n")
    daemon.start(wait=False)
    assert outcome(daemon) == EX_CONFIG, daemon.log()
    assert run_output(daemon) == [
        f"turnkeeper: configuration error: auth.tokens_file {tokens} {error}"
    ]


# --- secrets inside URLs ---------------------------------------------------------------

PASSWORD = "hunter2-url-secret"
API_KEY = "sk-url-test-8e6c4a2f0d1b3e5a7c9f"
LEAKY_SERVER = (
    f"import sys; print('connecting to postgresql://mcp:{PASSWORD}@db/x', file=sys.stderr)"
)


class _RefusingModel(BaseHTTPRequestHandler):
    """A chat-completions server that records the Authorization it gets and refuses."""

    authorizations: list[str] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).authorizations.append(self.headers.get("Authorization", ""))
        answer_json(self, 400, {"error": {"message": "model 'm' is not loaded"}})

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def refusing_model() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RefusingModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(120)
def test_a_password_in_a_url_is_masked_everywhere_and_never_replaces_the_api_key(
    daemons: Daemons, tmp_path: Path, refusing_model: int
) -> None:
    _RefusingModel.authorizations = []
    base_url = f"http://tk:{PASSWORD}@127.0.0.1:{refusing_model}/v1"
    daemon = small_daemon(
        daemons,
        tmp_path,
        model={"provider": "openai", "base_url": base_url, "model": "m", "api_key_env": "TK_KEY"},
        # A tool server that prints the URL of its database, password included, and exits.
        mcp={"servers": [{"name": "leaky", "command": [PYTHON, "-c", LEAKY_SERVER]}]},
        log={"level": "DEBUG"},
    )
    private_file(tmp_path / "tokens", f"alice sha256:{digest(ALICE)}\n")
    daemon.env = {"TK_KEY": API_KEY}
    daemon.start()
    with daemon.client() as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
        assert http.post(f"/v1/sessions/{sid}/inject", json={"text": "hi"}).status_code == 202
    with Store(daemon.url, migrate=False) as store:
        ended = wait_until(lambda: turn_ended(store, sid), 30, "the turn")
        events = store.events.read(sid, limit=1000)
    assert ended.payload["outcome"] == "failed"
    assert f"model server http://127.0.0.1:{refusing_model}/v1 answered 400" in str(ended.payload)
    assert _RefusingModel.authorizations == [f"Bearer {API_KEY}"]
    wait_until(lambda: "postgresql://mcp:***@db/x" in daemon.log(), 30, "the tool server's line")
    shown = subprocess.run(
        [PYTHON, "-m", "supervisor", "--config", str(daemon.config_path), "config", "show"],
        cwd=REPO,
        env=python_env(
            TURNKEEPER_STORE__URL=f"postgresql://tk:{PASSWORD}@127.0.0.1:1/tk", TK_KEY=API_KEY
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f'base_url = "http://tk:***@127.0.0.1:{refusing_model}/v1"' in shown.stdout
    assert 'url = "postgresql://tk:***@127.0.0.1:1/tk"' in shown.stdout
    everything = (
        daemon.log() + shown.stdout + shown.stderr + json.dumps([e.payload for e in events])
    )
    assert PASSWORD not in everything
