"""One signed POST of a delivery to its target, and what came of it, in words.

Each target has an HTTP client of its own whose connection pool holds its
`delivery.concurrency` attempts: a target that takes connections and never answers uses
up its own pool, never another target's. An attempt is bounded whole by the target's
`timeout` (httpx's bounds each read), and is judged on the status line: the body of the
answer is never read, so a slow or endless one neither fails a 2xx nor fills memory.
Whatever goes wrong in building or sending the request (a URL httpx refuses, a refused
connection, a TLS error) is a failed attempt with its reason; only a cancel goes through.
After the status line, at most `BODY_MAX` bytes of the body are read for `BODY_WAIT`
seconds, so that the connection can be used again.

A target's name is looked up here, in threads of the poster's own, at most
`LOOKUP_THREADS` at once (a lookup that hangs holds one of them, never a thread of the
supervisor's database work, which httpx's own lookups would use; they are daemon
threads, so one that never returns does not hold up the exit), kept `RESOLVED_FOR`
seconds, and the request goes to the address with the name in its `Host` header and, for
https, in the TLS handshake (SNI, and the certificate is checked against it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Collection

import httpx

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.deliveries import rules

USER_AGENT = "turnkeeper-delivery"
ERROR_CHARS = 200
BODY_MAX = 64 * 1024  # bytes of an answer's body read (then the connection is dropped)
BODY_WAIT = 1.0  # seconds its body may take (the status line has decided already)
RESOLVED_FOR = 30.0  # seconds a looked-up address is used
LOOKUP_THREADS = 4

Resolve = Callable[[str, int], str]


def resolve(host: str, port: int) -> str:
    """The first address `host` resolves to (blocking; run in the poster's threads)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not found:
        raise OSError(f"{host} resolves to no address")
    return str(found[0][4][0])


class Poster:
    """The clients of the targets, made on first use; `retire` drops those of targets a
    reload changed, `aclose` ends them all."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        lookup: Resolve = resolve,
        clock: Clock = SYSTEM,
    ) -> None:
        self.transport = transport  # tests: an httpx.MockTransport for every target
        self.lookup = lookup
        self.clock = clock  # the signatures' timestamps and the looked-up addresses' ages
        self._clients: dict[tuple[str, int], httpx.AsyncClient] = {}
        self._using: dict[httpx.AsyncClient, int] = {}  # attempts in flight, by client
        self._retired: set[httpx.AsyncClient] = set()  # a reload's: closed once not in use
        self._closing: set[asyncio.Future[None]] = set()  # a reload's idle ones, closing
        self._resolved: dict[tuple[str, int], tuple[str, float]] = {}
        self._looking = 0  # lookup threads alive (one may outlive its attempt)

    async def _address(self, url: httpx.URL) -> tuple[httpx.URL, dict[str, str], dict[str, str]]:
        """`url` sent to its host's address: the URL, the headers and the extensions."""
        host, port = url.host, url.port or (443 if url.scheme == "https" else 80)
        if self.transport is not None:
            return url, {}, {}  # a transport of the caller's own decides where it goes
        try:
            ipaddress.ip_address(host)
            return url, {}, {}  # an address already: nothing to look up
        except ValueError:
            pass
        key, now = (host, port), self.clock.monotonic()
        cached = self._resolved.get(key)
        if cached is not None and cached[1] > now:
            address = cached[0]
        else:
            address = await self._look_up(host, port)
            self._resolved[key] = (address, now + RESOLVED_FOR)
        extensions = {"sni_hostname": host} if url.scheme == "https" else {}
        return url.copy_with(host=address), {"Host": url.netloc.decode("ascii")}, extensions

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
        stamp = int(self.clock.time())
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            rules.TIMESTAMP_HEADER: str(stamp),
            rules.SIGNATURE_HEADER: rules.signature(secret.encode(), stamp, content),
        }
        client = self._client(target, concurrency)
        self._using[client] = self._using.get(client, 0) + 1
        try:
            return await self._send(client, target, content, headers)
        finally:
            await self._put_back(client)

    async def _send(
        self,
        client: httpx.AsyncClient,
        target: DeliveryTarget,
        content: bytes,
        headers: dict[str, str],
    ) -> tuple[int | None, str]:
        code: int | None = None
        reason = ""
        try:
            async with asyncio.timeout(target.timeout):
                url, host, extensions = await self._address(httpx.URL(target.url))
                request = client.stream(
                    "POST",
                    url,
                    content=content,
                    headers=headers | host,
                    timeout=target.timeout,
                    extensions=extensions,
                )
                async with request as response:  # the status line decides
                    code, reason = response.status_code, response.reason_phrase
                    await _drain(response)
        except (httpx.TimeoutException, TimeoutError):
            if code is None:
                return None, f"no answer within {target.timeout} s"
        except Exception as exc:  # refused, reset, TLS, a URL httpx cannot send to...
            if code is None:
                return None, f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return code, "" if 200 <= code < 300 else f"HTTP {code} {reason}"[:ERROR_CHARS]

    async def _put_back(self, client: httpx.AsyncClient) -> None:
        left = self._using[client] = self._using[client] - 1
        if left <= 0:
            del self._using[client]
            if client in self._retired:
                self._retired.discard(client)
                with contextlib.suppress(Exception):
                    await client.aclose()

    def retire(self, names: Collection[str]) -> None:
        """A reload removed or changed these targets: their clients take no new attempt
        (the next one makes a client of the target as it is now), and each is closed once
        the attempts it carries end (an idle one at once, in the background: the reload
        that calls this does not wait)."""
        for key in [key for key in self._clients if key[0] in names]:
            client = self._clients.pop(key)
            if self._using.get(client):
                self._retired.add(client)
            else:
                closing = spawn(_close(client))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        clients, self._clients = [*self._clients.values(), *self._retired], {}
        self._retired = set()
        for client in clients:
            with contextlib.suppress(Exception):  # one that will not close: the stop goes on
                await client.aclose()

    async def _look_up(self, host: str, port: int) -> str:
        if self._looking >= LOOKUP_THREADS:
            raise OSError(f"{LOOKUP_THREADS} lookups of target names are not answering")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[str] = loop.create_future()

        def settle(value: str, error: BaseException | None) -> None:
            self._looking -= 1  # on the loop's thread: no lock needed
            if answer.done():
                return  # its attempt ended (a timeout): the address is not wanted now
            if error is None:
                answer.set_result(value)
            else:
                answer.set_exception(error)

        def work() -> None:
            value, error = "", None
            try:
                value = self.lookup(host, port)
            except BaseException as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle, value, error)

        self._looking += 1
        threading.Thread(target=work, name="turnkeeper-lookup", daemon=True).start()
        return await answer


async def _close(client: httpx.AsyncClient) -> None:
    with contextlib.suppress(Exception):  # one that will not close: nothing waits on it
        await client.aclose()


async def _drain(response: httpx.Response) -> None:
    """Read a little of the body, briefly, so that the connection can be used again; a body
    longer or slower than that only costs the connection."""
    read = 0
    with contextlib.suppress(Exception):
        async with asyncio.timeout(BODY_WAIT):
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read > BODY_MAX:
                    return
