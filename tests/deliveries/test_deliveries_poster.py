"""The courier's POSTs against real servers on loopback, in the test's event loop: a target
that takes connections and never answers starves no other target (each has its own
connections); a request that cannot even be built or sent is a failed attempt, not a
claim held for good; a 2xx is decided on its status line (a slow or endless body is
never read); and a stop while a 2xx's verdict is being written keeps it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from supervisor.contract.config import Config, ConfigError, load_config
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.core.vocabulary import AttemptOutcome
from supervisor.deliveries.service import Courier
from supervisor.metrics import Metrics
from supervisor.store import DeliveryInfo, Store
from tests.deliveries.test_deliveries_courier import OWNER, Watch, answer, bound, rows, running

ENV = "TK_TEST_POSTER_SECRET"
WAIT = 30.0  # seconds a test waits for what it expects at most
HUNG = 110  # sessions bound to the target that never answers: past httpx's default pool (100)
LONG = 120.0  # the hung target's timeout: longer than any test


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "secret of the poster tests")


def config(targets: dict[str, tuple[str, float]], **delivery: Any) -> Config:
    """`targets`: name -> (url, timeout)."""
    listed = [
        {"name": name, "url": url, "secret_env": ENV, "timeout": timeout}
        for name, (url, timeout) in targets.items()
    ]
    settings = {"poll_interval": 0.05, "backoff": 0.01, "backoff_cap": 0.02, "max_attempts": 3}
    return Config.model_validate({"delivery": settings | {"targets": listed} | delivery})


def courier(store: Store, cfg: Config, transport: Any = None) -> tuple[Courier, Watch, Metrics]:
    metrics = Metrics()
    made = Courier(cfg, store, OWNER, metrics, jitter=lambda: 0.0, transport=transport)
    return made, Watch(made), metrics


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """An HTTP/1.1 server on loopback in this loop; `handle` plays each connection."""

    def __init__(self, handle: Handler) -> None:
        self.handle = handle
        self.connections = 0
        self.requests: list[bytes] = []
        self.changed = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    def url(self, path: str = "/in") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        self.connections += 1
        self.changed.set()
        try:
            await self.handle(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: what a poster that stops reading does
        finally:
            self.tasks.discard(task)
            writer.close()

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = await reader.readexactly(length)
        self.requests.append(body)
        self.changed.set()
        return head.split(b" ")[1]  # the path


@contextlib.asynccontextmanager
async def serving(handle: Handler) -> AsyncIterator[Server]:
    server = Server(handle)
    server.server = await asyncio.start_server(server._serve, "127.0.0.1", 0, backlog=512)
    try:
        yield server
    finally:
        server.server.close()
        for task in list(server.tasks):
            task.cancel()
        await asyncio.gather(*server.tasks, return_exceptions=True)


async def never_answers(reader: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    await s.read_request(reader)
    await asyncio.Event().wait()  # until the test ends


async def answers_200(reader: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    while True:  # keep-alive: every request on the connection
        await s.read_request(reader)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await w.drain()


def test_a_target_that_takes_connections_and_never_answers_starves_no_other(
    store: Store,
) -> None:
    hung_sessions = [bound(store, "hung", answers=1) for _ in range(HUNG)]
    live = bound(store, "live")

    async def main() -> None:
        async with serving(never_answers) as hung, serving(answers_200) as ok:
            targets = {"hung": (hung.url(), LONG), "live": (ok.url(), 10.0)}
            made, watch, _ = courier(store, config(targets, concurrency=128, max_attempts=1))
            async with running(made):
                # More requests hang than one shared pool of httpx's default 100 holds.
                await hung.until(lambda: len(hung.requests) >= 100)
                seq = answer(store, live, "through")
                made.nudge(live, {"type": "model_response", "seq": seq})
                await watch.until(lambda: len(watch.outcomes) >= 1)
                assert watch.outcomes[0][1] is AttemptOutcome.DELIVERED, rows(store, live)
                [done] = rows(store, live)
                assert (done.status, done.attempts, done.last_code) == ("delivered", 1, 200)
                await hung.until(lambda: len(hung.requests) == HUNG)  # its own room: all sent
                held = [d for s in hung_sessions for d in rows(store, s)]
                assert {(d.status, d.attempts, d.claimed_by) for d in held} == {
                    ("pending", 0, OWNER)
                }
                assert len(watch.outcomes) == 1  # none of the hung ones finished

    asyncio.run(main())


def test_a_url_httpx_refuses_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "turnkeeper.toml"
    body = f'[[delivery.targets]]\nname = "t"\nsecret_env = "{ENV}"\nurl = "http://bücher..de/in"\n'
    path.write_text(body, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), environ={})
    assert "delivery.targets[0].url" in str(caught.value)


def test_a_request_that_cannot_be_built_or_sent_is_a_failed_attempt(store: Store) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("not an httpx error")

    cfg = config({"boom": ("http://boom.test/in", 5.0)}, max_attempts=2)
    # What the configuration now refuses, as an older or hand-made one could still hold.
    bad = DeliveryTarget.model_construct(
        name="bad", url="http://bücher..de/in", secret_env=ENV, timeout=5.0,
        events=["answer", "notice"], principals=[],
    )  # fmt: skip
    cfg.delivery.targets.append(bad)
    broken, idna = bound(store, "boom", answers=1), bound(store, "bad", answers=1)
    after_first: dict[str, DeliveryInfo | None] = {}

    async def main() -> None:
        made, watch, _ = courier(store, cfg, transport=httpx.MockTransport(refuse))

        def first(delivery_id: str, outcome: AttemptOutcome) -> None:
            if outcome is AttemptOutcome.FAILED:
                after_first[delivery_id] = store.deliveries.get(delivery_id)

        made.on_finished.append(first)
        async with running(made):
            await watch.until(lambda: watch.count(AttemptOutcome.DEAD) == 2)
        assert watch.count(AttemptOutcome.FAILED) == 2

    asyncio.run(main())
    for sid, error in ((broken, "RuntimeError: not an httpx error"), (idna, "InvalidURL")):
        [d] = rows(store, sid)
        once = after_first[d.id]  # after its first attempt
        assert once is not None and once.last_error.startswith(error), once
        assert (once.status, once.attempts, once.claimed_by, once.last_code) == (
            "pending", 1, None, None,
        )  # fmt: skip
        assert (d.status, d.attempts, d.last_code, d.claimed_by) == ("dead", 2, None, None)
        assert d.last_error.startswith(error), d


async def slow_or_endless(reader: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    path = await s.read_request(reader)
    if path == b"/slow":  # 200 at once, then a body a byte at a time, far past the timeout
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while True:
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(b"x")
    else:  # 200 at once, then a chunked body that never ends
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        while True:
            await w.drain()
            w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await asyncio.sleep(0.005)


def test_a_2xx_is_decided_on_its_status_line_whatever_its_body_does(store: Store) -> None:
    slow, endless = bound(store, "slow", answers=1), bound(store, "endless", answers=1)

    async def main() -> None:
        async with serving(slow_or_endless) as server:
            targets = {"slow": (server.url("/slow"), 1.0), "endless": (server.url("/x"), 1.0)}
            made, watch, _ = courier(store, config(targets))
            async with running(made):
                await watch.until(lambda: len(watch.outcomes) == 2)
            assert [o for _, o in watch.outcomes] == [AttemptOutcome.DELIVERED] * 2
            assert len(server.requests) == 2  # each sent once

    asyncio.run(main())
    for sid in (slow, endless):
        [d] = rows(store, sid)
        assert (d.status, d.attempts, d.last_code, d.last_error) == ("delivered", 1, 200, "")


def test_a_stop_while_a_2xx_verdict_is_written_keeps_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = bound(store, "hook", answers=1)
    finish, release = store.deliveries.finish, store.deliveries.release
    writing, gate = threading.Event(), threading.Event()

    def held_finish(*args: Any, **kwargs: Any) -> bool:
        writing.set()
        gate.wait(WAIT)
        return finish(*args, **kwargs)

    def opening_release(owner: str, *rest: float) -> int:
        released = release(owner, *rest)
        gate.set()  # a stop that did not wait for the verdict: it is written after this
        return released

    monkeypatch.setattr(store.deliveries, "finish", held_finish)
    monkeypatch.setattr(store.deliveries, "release", opening_release)

    async def main() -> None:
        cfg = config({"hook": ("http://hook.test/in", 5.0)})
        made, _, _ = courier(
            store, cfg, transport=httpx.MockTransport(lambda r: httpx.Response(200))
        )
        task = asyncio.create_task(made.run())
        await asyncio.to_thread(writing.wait, WAIT)
        assert writing.is_set()
        task.cancel()  # the stop, while the 2xx's verdict is being written
        # A stop that waits for the verdict never releases first: open the gate for it.
        asyncio.get_running_loop().call_later(0.5, gate.set)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    [d] = rows(store, sid)
    assert (d.status, d.attempts, d.last_code, d.claimed_by) == ("delivered", 1, 200, None)
