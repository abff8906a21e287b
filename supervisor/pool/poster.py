"""One signed POST of a delivery to its target, and what came of it, in words.

Each target has an HTTP client of its own whose connection pool holds its
`delivery.concurrency` attempts: a target that takes connections and never answers uses
up its own pool, never another target's. An attempt is bounded whole by the target's
`timeout` (httpx's bounds each read), and is judged on the status line: the body of the
answer is never read, so a slow or endless one neither fails a 2xx nor fills memory.
Whatever goes wrong in building or sending the request (a URL httpx refuses, a refused
connection, a TLS error) is a failed attempt with its reason; only a cancel goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import httpx

from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.core import deliveries as rules

USER_AGENT = "turnkeeper-delivery"
ERROR_CHARS = 200


class Poster:
    """The clients of the targets, made on first use; `aclose` ends them."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.transport = transport  # tests: an httpx.MockTransport for every target
        self._clients: dict[tuple[str, int], httpx.AsyncClient] = {}

    def _client(self, target: DeliveryTarget, concurrency: int) -> httpx.AsyncClient:
        key = (target.name, concurrency)
        client = self._clients.get(key)
        if client is None:
            limits = httpx.Limits(
                max_connections=concurrency, max_keepalive_connections=concurrency
            )
            client = self._clients[key] = httpx.AsyncClient(
                transport=self.transport,
                limits=limits,
                follow_redirects=False,
                trust_env=False,  # no proxy from the environment: a target is a URL as written
                headers={"User-Agent": USER_AGENT},
            )
        return client

    async def post(
        self, target: DeliveryTarget, concurrency: int, key: str, content: bytes
    ) -> tuple[int | None, str]:
        """POST `content` signed to `target`: (HTTP status or None, what went wrong or "")."""
        secret = os.environ.get(target.secret_env, "")
        if not secret:  # checked at start; unset since: nothing is sent unsigned
            return None, f"{target.secret_env} is not set: nothing sent"
        stamp = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            rules.TIMESTAMP_HEADER: str(stamp),
            rules.SIGNATURE_HEADER: rules.signature(secret.encode(), stamp, content),
        }
        client = self._client(target, concurrency)
        try:
            async with asyncio.timeout(target.timeout):
                request = client.stream(
                    "POST", target.url, content=content, headers=headers, timeout=target.timeout
                )
                async with request as response:  # the status line decides; no body is read
                    code, reason = response.status_code, response.reason_phrase
        except (httpx.TimeoutException, TimeoutError):
            return None, f"no answer within {target.timeout} s"
        except Exception as exc:  # refused, reset, TLS, a URL httpx cannot send to...
            return None, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return code, "" if 200 <= code < 300 else f"HTTP {code} {reason}"[:ERROR_CHARS]

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):  # one that will not close: the stop goes on
                await client.aclose()
