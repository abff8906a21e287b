"""Wakes across daemons: a NOTIFY from one daemon's store reaches another daemon's
listener on PostgreSQL, on the channel of its own schema only; elsewhere nothing listens
(the pool's probe finds the input)."""

from __future__ import annotations

import asyncio
import os
import resource

import pytest

from supervisor.pool.signals import CHANNEL, Signals, channel_of
from supervisor.store import Store


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_announced_session_wakes_the_listener_of_the_same_database(db_url: str) -> None:
    async def scenario() -> list[str]:
        heard: list[str] = []
        got = asyncio.Event()

        def on_wake(session_id: str) -> None:
            heard.append(session_id)
            got.set()

        with Store(db_url) as listening, Store(db_url) as sending:
            listener = Signals(listening, on_wake)
            sender = Signals(sending, lambda s: None)
            assert listener.enabled and listener.channel != CHANNEL  # the schema's own
            await listener.start()
            try:
                # LISTEN is issued in the listener's thread: announce until it hears.
                for _ in range(100):
                    await asyncio.to_thread(sender.announce, "session-1")
                    try:
                        await asyncio.wait_for(got.wait(), 0.1)
                        break
                    except TimeoutError:
                        continue
                await asyncio.to_thread(sender.announce, "bad id; DROP TABLE session")
                await asyncio.to_thread(sender.announce, "session-2")
                for _ in range(50):
                    if "session-2" in heard:
                        break
                    await asyncio.sleep(0.05)
            finally:
                await listener.stop()
        return heard

    heard = asyncio.run(scenario())
    assert set(heard) == {"session-1", "session-2"}  # the malformed payload is dropped


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_listener_hears_on_a_connection_numbered_above_what_select_takes(
    db_url: str,
) -> None:
    # The daemon raises its descriptor limit (issue 32): with many HTTP clients open, the
    # listener's connection may be numbered above 1023, where select() refuses it.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2048:
        pytest.skip(f"the soft file descriptor limit ({soft}) leaves no room above 1024")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]

    async def scenario() -> bool:
        got = asyncio.Event()
        with Store(db_url) as listening, Store(db_url) as sending:
            listener = Signals(listening, lambda session_id: got.set())
            sender = Signals(sending, lambda s: None)
            await listener.start()
            try:
                for _ in range(100):  # LISTEN is issued in the listener's thread
                    await asyncio.to_thread(sender.announce, "session-1")
                    try:
                        await asyncio.wait_for(got.wait(), 0.1)
                        return True
                    except TimeoutError:
                        continue
                return False
            finally:
                await listener.stop()

    try:
        assert asyncio.run(scenario()), "the wake was never heard"
    finally:
        for fd in held:
            os.close(fd)


@pytest.mark.parametrize("db_url", ["sqlite", "mysql"], indirect=True)
def test_other_databases_have_no_channel(db_url: str) -> None:
    with Store(db_url) as store:
        signals = Signals(store, lambda s: None)
        assert not signals.enabled
        signals.announce("session-1")  # nothing to send: the probe finds the input


def test_each_schema_has_a_channel_of_its_own() -> None:
    assert channel_of({}) == CHANNEL
    a = channel_of({"options": "-csearch_path=tk_a"})
    b = channel_of({"options": "-csearch_path=tk_b"})
    assert a != b and a.startswith(CHANNEL + "_")
