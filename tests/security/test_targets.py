"""A delivery target that lists its principals keeps a session's replies (issue 28): a
principal it does not list can neither bind a session to it nor take a session away from
it, and is told only of the targets it may use. A real daemon."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon import Daemon, daemons, tokens_file

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]
pytestmark = pytest.mark.timeout(120)

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}


def test_a_session_bound_to_a_listed_target_stays_there(daemons: Daemons, tmp_path: Path) -> None:
    targets = [
        {
            "name": "ops",
            "url": "http://127.0.0.1:9/ops",
            "secret_env": "TK_TEST_SECRET",
            "principals": ["alice"],
        },
        {"name": "public", "url": "http://127.0.0.1:9/public", "secret_env": "TK_TEST_SECRET"},
    ]
    daemon = daemons(
        auth={"tokens_file": str(tokens_file(tmp_path / "tokens", TOKENS))},
        delivery={"targets": targets},
    )
    daemon.env = {"TK_TEST_SECRET": "a-secret-of-the-operator"}
    daemon.start()
    with daemon.client() as alice, daemon.client() as bob:
        alice.headers["Authorization"] = f"Bearer {TOKENS['alice']}"
        bob.headers["Authorization"] = f"Bearer {TOKENS['bob']}"
        made = alice.post("/v1/sessions", json={"deliver_to": "ops"})
        assert made.status_code == 201, made.text
        session = made.json()["id"]
        alice.put(f"/v1/sessions/{session}/acl", json={"principal": "bob", "permission": "write"})
        for target in ("public", None):
            moved = bob.put(f"/v1/sessions/{session}", json={"deliver_to": target})
            assert moved.status_code == 403, moved.text
            assert "ops" in moved.json()["error"]["message"]
        assert bob.get(f"/v1/sessions/{session}").json()["deliver_to"] == "ops"
        unknown = bob.post("/v1/sessions", json={"deliver_to": "nope"})
        assert unknown.status_code == 422
        message = unknown.json()["error"]["message"]
        assert "public" in message and "ops" not in message
        # Alice, whom ops lists, may move it.
        moved = alice.put(f"/v1/sessions/{session}", json={"deliver_to": "public"})
        assert moved.status_code == 200 and moved.json()["deliver_to"] == "public"
