"""SIGTERM while a client injects: no 202 without a committed event, none lost."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from supervisor.store import Store
from tests.daemon import Daemon, daemons, wait_until

__all__ = ["daemons"]


@pytest.mark.timeout(120)
def test_sigterm_while_injecting_loses_no_acknowledged_message(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    socket = tmp_path / "api.sock"
    daemon = daemons(http={"listen": f"unix:{socket}"}).start()
    client = daemon.client()
    sessions = [client.post("/v1/sessions", json={}).json()["id"] for _ in range(5)]
    answers: list[tuple[str, str, int | str, dict[str, str]]] = []
    stop = threading.Event()

    def inject_forever() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            sid, text = sessions[n % len(sessions)], f"message {n}"
            try:
                reply = client.post(
                    f"/v1/sessions/{sid}/inject",
                    json={"text": text},
                    headers={"Idempotency-Key": f"k{n}"},
                )
                answers.append((sid, text, reply.status_code, dict(reply.headers)))
            except httpx.TransportError as exc:
                answers.append((sid, text, type(exc).__name__, {}))
                time.sleep(0.01)

    sender = threading.Thread(target=inject_forever)
    sender.start()
    try:
        wait_until(lambda: sum(1 for a in answers if a[2] == 202) >= 50, 30, "some injects")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
        time.sleep(0.3)  # a few more attempts against the stopped daemon
    finally:
        stop.set()
        sender.join(10)
        client.close()

    accepted = [(sid, text) for sid, text, status, _ in answers if status == 202]
    refused = [(status, headers) for _, _, status, headers in answers if status != 202]
    assert accepted and refused, "the test must see both answers"
    for status, headers in refused:
        if status == 503:
            assert headers.get("retry-after") == "5"
        else:
            assert isinstance(status, str), f"unexpected answer {status}"  # a transport error
    daemon.start()
    with Store(daemon.url, migrate=False) as store:
        stored: dict[tuple[str, str], int] = {}
        for sid in sessions:
            for event in store.events.read(sid, limit=100_000):
                if event.type == "user_message":
                    key = (sid, event.payload["text"])
                    stored[key] = stored.get(key, 0) + 1
    missing = [a for a in accepted if a not in stored]
    assert missing == [], f"{len(missing)} acknowledged messages were lost"
    assert all(count == 1 for count in stored.values())
    print(
        f"{len(accepted)} accepted, {len(refused)} refused "
        f"({sum(1 for s, _ in refused if s == 503)} with 503)"
    )
