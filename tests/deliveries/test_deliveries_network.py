"""What a delivery does on the network, and what it may not hold up: a target's name is
looked up in the poster's own threads (a lookup that hangs holds none of the
supervisor's database threads) and sent to with the name in `Host`; a connection is used
again for the next attempt; the claim's "no earlier pending row" is an index probe; a
stop does not wait on a database that went away for longer than the courier's cap."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.deliveries import service as courier_module
from supervisor.deliveries.poster import LOOKUP_THREADS, Poster
from supervisor.store import Store
from tests.deliveries.test_deliveries_poster import ENV, Server, config, courier, secret, serving

__all__ = ["secret"]  # the fixture

WAIT = 30.0


def target(url: str, timeout: float = 5.0) -> DeliveryTarget:
    return DeliveryTarget(name="hook", url=url, secret_env=ENV, timeout=timeout)


async def heads_200(reader: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    """Answers 200 with a small body to every request of the connection; keeps each head."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        s.requests.append(head)
        s.changed.set()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nhello there")
        await w.drain()


def test_a_name_is_looked_up_by_the_poster_and_sent_in_the_host_header() -> None:
    asked: list[tuple[str, int]] = []

    def lookup(host: str, port: int) -> str:
        asked.append((host, port))
        return "127.0.0.1"

    async def main() -> None:
        async with serving(heads_200) as server:
            poster = Poster(lookup=lookup)
            hook = target(f"http://receiver.test:{server.port}/in")
            try:
                for n in range(5):
                    assert await poster.post(hook, 4, f"k{n}", b"{}") == (200, "")
            finally:
                await poster.aclose()
            heads = [head.lower() for head in server.requests]
            assert all(f"host: receiver.test:{server.port}".encode() in h for h in heads)
            # One lookup, kept for the next attempts; one connection, used again.
            assert asked == [("receiver.test", server.port)]
            assert server.connections == 1

    asyncio.run(main())


def test_a_lookup_that_hangs_holds_no_database_thread_and_fails_the_attempt() -> None:
    gate = threading.Event()

    def hanging(host: str, port: int) -> str:
        gate.wait(WAIT)
        raise OSError("the resolver never answered")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # The supervisor's database threads are the loop's default executor: one here.
        loop.set_default_executor(ThreadPoolExecutor(1, "database"))
        poster = Poster(lookup=hanging)
        hook = target("http://stuck.test/in", timeout=0.3)
        try:
            tried = [poster.post(hook, 4, f"k{n}", b"{}") for n in range(LOOKUP_THREADS)]
            for code, error in await asyncio.gather(*tried):
                assert code is None and "no answer within 0.3 s" in error
            # The lookups still hang; the database's thread is free all along.
            started = time.monotonic()
            assert await asyncio.to_thread(lambda: "served") == "served"
            assert time.monotonic() - started < 1.0
            # More hung lookups than its threads: the next attempt fails at once.
            code, error = await poster.post(hook, 4, "k-more", b"{}")
            assert code is None and "lookups of target names are not answering" in error
        finally:
            gate.set()
            await poster.aclose()

    asyncio.run(main())


def test_the_claims_check_of_earlier_rows_is_an_index_probe(tmp_path: Any) -> None:
    with Store(f"sqlite:///{tmp_path / 'plan.db'}") as store:
        captured: list[str] = []
        db = store.db
        real = db.execute_sql

        def capture(sql: str, params: Any = None, *rest: Any, **kw: Any) -> Any:
            if sql.lstrip().upper().startswith("SELECT") and "earlier" in sql:
                captured.append(sql)
                plan = real("EXPLAIN QUERY PLAN " + sql, params).fetchall()
                captured.append(" | ".join(str(row[-1]) for row in plan))
            return real(sql, params, *rest, **kw)

        db.execute_sql = capture  # type: ignore[method-assign]
        try:
            store.deliveries.claim("h/b", {"hook": 10.0}, 4)
        finally:
            db.execute_sql = real  # type: ignore[method-assign]
        assert captured, "the claim's query was not seen"
        plan = captured[-1]
        assert "delivery_session_target_status_seq" in plan, plan


def test_a_stop_waits_at_most_its_cap_on_a_database_that_went_away(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = store.deliveries.release

    def slow_release(owner: str, *rest: float) -> int:
        time.sleep(courier_module.SETTLE_CAP * 4)  # a database that does not answer
        return release(owner, *rest)

    monkeypatch.setattr(store.deliveries, "release", slow_release)

    async def main() -> float:
        cfg = config({"hook": ("http://127.0.0.1:9/in", 5.0)}, poll_interval=60.0)
        made, _, _ = courier(store, cfg)
        task = asyncio.create_task(made.run())
        await asyncio.sleep(0.3)  # its first pass: nothing to do but sleep
        started = time.monotonic()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return time.monotonic() - started

    took = asyncio.run(main())
    assert took < courier_module.SETTLE_CAP * 3, took
