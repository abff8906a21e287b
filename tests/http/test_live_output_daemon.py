"""A turn's live output end to end: a real daemon, its workers streaming the echo model's
answer (word by word, `model.delay` spread over the words), a client attached over HTTP.

The client sees several deltas before `turn_ended`; joined, a turn's deltas are the
committed answer; the history and a replay hold no delta. A client that reads nothing
while the turn runs does not hold it up: the turn ends, and the client then reads every
committed event.

Needs the worker side (the coalescer `workers/streaming.py`): skipped until it is there.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.store import Store
from tests.conftest import REPO
from tests.daemon import Daemon, daemons, turn_ended, wait_until

__all__ = ["daemons"]  # the fixture

pytestmark = pytest.mark.skipif(
    not (REPO / "workers" / "streaming.py").exists(),
    reason="needs the worker side: workers that send deltas (the stream-worker branch)",
)

WORDS = " ".join(f"word{i}" for i in range(40))
SETTINGS: dict[str, Any] = {
    "agent": {"class": "workers.agents.tool_loop:ToolLoopAgent"},
    "model": {"delay": 2.0},  # 40 words over 2 s: a word every 50 ms
}
WAIT_S = 60.0  # a bound on waiting for what must happen, not a measure of speed


def messages(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Each SSE message of an attach stream: `id` (None for a delta), `event`, `data`."""
    fields: dict[str, str] = {}
    for line in lines:
        if line:
            if not line.startswith(":"):
                name, _, value = line.partition(":")
                fields[name] = value.removeprefix(" ")
            continue
        if fields:
            seq = fields.get("id")
            yield {
                "id": None if seq is None else int(seq),
                "event": fields["event"],
                "data": json.loads(fields["data"]),
            }
        fields = {}


def session(daemon: Daemon) -> str:
    with daemon.client() as client:
        return str(client.post("/v1/sessions", json={}).json()["id"])


def test_deltas_stream_before_the_turn_ends_and_join_into_the_answer(daemons: Any) -> None:
    daemon: Daemon = daemons(**SETTINGS).start()
    sid = session(daemon)
    with daemon.client() as client:
        with client.stream("GET", f"/v1/sessions/{sid}/attach", timeout=WAIT_S) as stream:
            sent = client.post(f"/v1/sessions/{sid}/inject", json={"text": WORDS})
            assert sent.status_code == 202, sent.text
            got: list[dict[str, Any]] = []
            for message in messages(stream.iter_lines()):
                got.append(message)
                if message["event"] == "turn_ended":
                    break
        deltas = [m for m in got if m["event"] == "delta"]
        assert len(deltas) >= 3, got  # several, before turn_ended
        assert all(m["id"] is None for m in deltas)
        assert [d["data"]["index"] for d in deltas] == list(range(len(deltas)))
        answers = [m["data"]["payload"]["text"] for m in got if m["event"] == "model_response"]
        assert "".join(d["data"]["text"] for d in deltas) == "".join(answers)
        assert answers == [f"echo: {WORDS}"]

        history = client.get(f"/v1/sessions/{sid}/events").json()["events"]
        assert "delta" not in {e["type"] for e in history}
        with client.stream(
            "GET", f"/v1/sessions/{sid}/attach", headers={"Last-Event-ID": "0"}, timeout=WAIT_S
        ) as replay:
            replayed = []
            for message in messages(replay.iter_lines()):
                replayed.append(message)
                if message["event"] == "turn_ended":
                    break
        assert [m["id"] for m in replayed] == [e["seq"] for e in history]
        assert all(m["event"] != "delta" for m in replayed)


def test_a_client_that_reads_nothing_does_not_hold_up_the_turn(
    daemons: Any, tmp_path: Path
) -> None:
    daemon: Daemon = daemons(**SETTINGS).start()
    sid = session(daemon)
    token = (daemon.state / "admin.token").read_text().strip()
    # A raw client that sends its request and then reads nothing, its buffer kept small.
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(daemon.listen.removeprefix("unix:"))
    try:
        reader.sendall(
            f"GET /v1/sessions/{sid}/attach HTTP/1.1\r\nHost: turnkeeper\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        wait_until(lambda: daemon.status()["attach_streams"] == 1, WAIT_S, "the stream")
        with daemon.client() as client:
            sent = client.post(f"/v1/sessions/{sid}/inject", json={"text": WORDS * 20})
            assert sent.status_code == 202, sent.text
        with Store(daemon.url) as store:
            ended = wait_until(lambda: turn_ended(store, sid), WAIT_S, "the turn to end")
        assert ended.payload["outcome"] == "completed"
        # Now the client reads: every committed event came through, up to turn_ended.
        reader.settimeout(WAIT_S)
        body = b""
        while b"event: turn_ended" not in body:
            chunk = reader.recv(65536)
            assert chunk, body[-2000:]
            body += chunk
        head, _, sse = body.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        seqs = [int(line[4:]) for line in sse.split(b"\n") if line.startswith(b"id: ")]
        assert seqs == list(range(1, ended.seq + 1))
    finally:
        reader.close()


def test_an_interrupt_mid_stream_ends_the_turn_with_the_text_streamed_so_far(
    daemons: Any,
) -> None:
    """The answer streams slowly (a word every 250 ms); after a few deltas the client
    interrupts. The turn ends at once, in the interrupt's own transaction, and the log
    keeps what was streamed as the cut answer, just before `turn_ended`."""
    daemon: Daemon = daemons(**{**SETTINGS, "model": {"delay": 10.0}}).start()
    sid = session(daemon)
    with daemon.client() as client:
        with client.stream("GET", f"/v1/sessions/{sid}/attach", timeout=WAIT_S) as stream:
            sent = client.post(f"/v1/sessions/{sid}/inject", json={"text": WORDS})
            assert sent.status_code == 202, sent.text
            seen: list[str] = []
            for message in messages(stream.iter_lines()):
                if message["event"] == "delta":
                    seen.append(message["data"]["text"])
                if len(seen) >= 3:
                    break
        answered = client.post(f"/v1/sessions/{sid}/interrupt")
        assert answered.status_code == 200, answered.text
        assert answered.json()["interrupted"] is True
    with Store(daemon.url, migrate=False) as store:
        ended = wait_until(lambda: turn_ended(store, sid), WAIT_S, "the turn's end")
        assert ended.payload["outcome"] == "interrupted_by_operator"
        cut = store.events.read(sid, after=ended.seq - 2, limit=1)[0]
    assert cut.type == "model_response" and cut.seq == ended.seq - 1, cut
    assert cut.payload["finish_reason"] == "interrupted"
    # At least what the client saw before it interrupted; a word or two more may have come.
    assert cut.payload["text"].startswith("".join(seen)), (cut.payload, seen)
    whole = f"echo: {WORDS}"
    assert whole.startswith(cut.payload["text"]) and len(cut.payload["text"]) < len(whole)
