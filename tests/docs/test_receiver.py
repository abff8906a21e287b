"""The webhook receiver of docs/how-to/deliveries.md accepts what the daemon signs, and
refuses a wrong secret, a changed body and an old timestamp."""

from __future__ import annotations

import re
from typing import Any

from supervisor.deliveries.rules import signature
from tests.conftest import REPO

PAGE = REPO / "docs" / "how-to" / "deliveries.md"


def receiver() -> dict[str, Any]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    code = next(block for block in blocks if "def verify(" in block)
    namespace: dict[str, Any] = {"__name__": "receiver"}
    exec(compile(code, str(PAGE.relative_to(REPO)), "exec"), namespace)
    return namespace


def test_the_receiver_verifies_the_daemons_signature() -> None:
    verify = receiver()["verify"]
    secret, body, now = b"s3cret", b'{"delivery_id": "d1", "text": "hi"}', 1_700_000_000

    def headers(timestamp: int, sig: str) -> dict[str, str]:
        return {"X-Turnkeeper-Timestamp": str(timestamp), "X-Turnkeeper-Signature": sig}

    signed = signature(secret, now, body)
    assert verify(headers(now, signed), body, secret, now + 10)
    assert not verify(headers(now, signed), body, b"other", now)
    assert not verify(headers(now, signed), body + b" ", secret, now)
    assert not verify(headers(now, signed), body, secret, now + 3600)
    assert not verify(headers(now, "sha256=" + "0" * 64), body, secret, now)
    assert not verify({"X-Turnkeeper-Signature": signed}, body, secret, now)
