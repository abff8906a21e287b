"""Logs: journald detection, and no secret in the log of a full run."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from supervisor.contract.logs import to_journal
from supervisor.http.auth import digest
from supervisor.store import Store
from tests.conftest import PYTHON, REPO, python_env
from tests.daemon import Daemon, answer_json, daemons, turn_ended, wait_until
from tests.support import plain

__all__ = ["daemons"]  # the fixture

Daemons = Callable[..., Daemon]

API_KEY = "sk-test-4c7e1f0b9a2d4e6f8a1b3c5d7e9f0a1b"
USER_TOKEN = "tk-user-0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a"
WRONG_TOKEN = "tk-wrong-9f8e7d6c5b4a39281706f5e4d3c2b1a0"


def test_journal_stream_counts_only_when_it_names_stderr(tmp_path: Path) -> None:
    with (tmp_path / "err").open("w") as err:
        st = os.fstat(err.fileno())
        assert to_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, err.fileno())
        assert not to_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, err.fileno())
        assert not to_journal({"JOURNAL_STREAM": "garbage"}, err.fileno())
        assert not to_journal({}, err.fileno())


class _Model(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions server that checks the key it is sent."""

    keys: list[str] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        type(self).keys.append(self.headers.get("Authorization", ""))
        answer_json(
            self,
            200,
            {
                "choices": [
                    {
                        "message": {"role": "assistant", "content": "hello from the model"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4},
            },
        )

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def model_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Model)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(120)
def test_a_full_run_never_writes_a_token_or_an_api_key(
    daemons: Daemons, tmp_path: Path, model_server: str
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice sha256:{digest(USER_TOKEN)}\n")
    tokens.chmod(0o600)  # the daemon refuses a tokens file others can read
    daemon = daemons(
        http={"listen": f"unix:{tmp_path / 'api.sock'}"},
        auth={"tokens_file": str(tokens)},
        model={
            "provider": "openai",
            "base_url": model_server,
            "model": "m",
            "api_key_env": "TK_KEY",
        },
        log={"level": "DEBUG"},
    )
    daemon.env = {"TK_KEY": API_KEY}
    daemon.start()
    admin = (daemon.state / "admin.token").read_text().strip()
    transport = plain(str(tmp_path / "api.sock"))
    with httpx.Client(transport=transport, base_url="http://turnkeeper", timeout=10) as http:
        as_alice = {"Authorization": f"Bearer {USER_TOKEN}"}
        sid = http.post("/v1/sessions", json={}, headers=as_alice).json()["id"]
        seq = http.post(f"/v1/sessions/{sid}/inject", json={"text": "hi"}, headers=as_alice)
        assert seq.status_code == 202, seq.text
        with Store(daemon.url, migrate=False) as store:
            ended = wait_until(lambda: turn_ended(store, sid), 30, "the turn")
            assert ended.payload["outcome"] == "completed", ended.payload
        refused = http.get("/v1/sessions", headers={"Authorization": f"Bearer {WRONG_TOKEN}"})
        assert refused.status_code == 401
        assert http.get("/v1/status", headers={"Authorization": f"Bearer {admin}"}).is_success
    assert _Model.keys and all(k == f"Bearer {API_KEY}" for k in _Model.keys)
    shown = subprocess.run(
        [PYTHON, "-m", "supervisor", "--config", str(daemon.config_path), "config", "show"],
        cwd=REPO,
        env=python_env(TK_KEY=API_KEY),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    text = daemon.log() + shown.stdout + shown.stderr
    for secret in (API_KEY, USER_TOKEN, WRONG_TOKEN, admin, digest(USER_TOKEN), digest(admin)):
        assert secret not in text, f"a secret ({secret[:8]}...) was written to the log"
    # The run really logged: start, requests refused, the turn, the stop.
    assert "[daemon] ready:" in text and "stopped cleanly" in text
