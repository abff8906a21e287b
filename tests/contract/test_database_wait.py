"""The start's wait for a database server that is not there yet
(`supervisor.preflight.wait_for_database`), driven with a clock that moves by itself and a
stand-in for the connection try: its pace, its log lines, what systemd hears, its end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from loguru import logger

from supervisor.contract.errors import StartupError
from supervisor.notify import Notifier
from supervisor.preflight import AFTER_THE_WAIT, wait_for_database
from supervisor.store import BadStoreURL, NotAnswering, probe
from tests.clock import SteppingClock

URL = "postgresql://tk:s3cr3t@db.internal:5432/tk"
MASKED = "postgresql://tk:***@db.internal:5432/tk"


class Heard(Notifier):
    """A notifier that keeps what it would send to systemd."""

    def __init__(self) -> None:
        super().__init__(None)
        self.sent: list[dict[str, Any]] = []

    def send(self, **fields: str | int) -> bool:
        self.sent.append(fields)
        return True


def refused_until(clock: SteppingClock, up_at: float) -> Callable[[str], None]:
    """A connection try refused until `up_at` on `clock`."""

    def try_once(url: str) -> None:
        assert url == URL
        if clock.now < up_at:
            raise NotAnswering('connection to server at "db.internal" failed: Connection refused')

    return try_once


@pytest.fixture
def lines() -> Iterator[list[str]]:
    found: list[str] = []
    sink = logger.add(lambda m: found.append(str(m).rstrip()), level="INFO", format="{message}")
    yield found
    logger.remove(sink)


def wait(
    clock: SteppingClock, try_once: Callable[[str], None], timeout: float = 120.0, **kw: Any
) -> tuple[bool, Heard]:
    heard = Heard()

    async def main() -> bool:
        stopping = kw.get("stopping") or asyncio.Event()
        return await wait_for_database(
            URL, timeout, heard, stopping, try_once=try_once, clock=clock
        )

    return asyncio.run(main()), heard


def test_it_tries_again_with_a_backoff_and_starts_as_soon_as_the_server_answers(
    lines: list[str],
) -> None:
    clock = SteppingClock()
    done, heard = wait(clock, refused_until(clock, 33.0))
    assert done is True
    # 0.5 s doubling to 5 s; the server is up at 33 s, so the try at 37.5 s is the one.
    assert clock.slept == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    # A line at the first refusal, then one each time 10 s have passed: not one a try.
    waiting = [line for line in lines if line.startswith("waiting for the database")]
    assert [line.rsplit("(waited ", 1)[1] for line in waiting] == [
        "0 s of store.connect_timeout 120 s)",
        "12 s of store.connect_timeout 120 s)",
        "22 s of store.connect_timeout 120 s)",
        "32 s of store.connect_timeout 120 s)",
    ]
    assert all(MASKED in line and "Connection refused" in line for line in waiting), waiting
    assert not any("s3cr3t" in line for line in lines)
    assert lines[-1] == f"the database {MASKED} answered after 38 s"
    # systemd hears each line, with its start timeout stretched past the wait's end.
    assert [m["STATUS"].split(" (")[0] for m in heard.sent] == ["waiting for the database"] * 4
    assert heard.sent[0]["EXTEND_TIMEOUT_USEC"] == int((120 + AFTER_THE_WAIT) * 1e6)
    assert heard.sent[1]["EXTEND_TIMEOUT_USEC"] == int((107.5 + AFTER_THE_WAIT) * 1e6)
    assert "WATCHDOG" not in heard.sent[0]


def test_a_server_there_at_once_is_not_waited_for(lines: list[str]) -> None:
    clock = SteppingClock()
    done, heard = wait(clock, refused_until(clock, 0.0))
    assert (done, clock.slept, heard.sent, lines) == (True, [], [], [])


def test_past_the_timeout_the_start_fails_with_one_line() -> None:
    clock = SteppingClock()
    with pytest.raises(StartupError) as failed:
        wait(clock, refused_until(clock, 1e9), timeout=3.0)
    assert str(failed.value) == (
        f"the database {MASKED} did not answer within store.connect_timeout (3 s): "
        'connection to server at "db.internal" failed: Connection refused'
    )
    assert sum(clock.slept) == 3.0  # the last pause is cut to the deadline


def test_no_wait_at_all_with_a_timeout_of_0() -> None:
    clock = SteppingClock()
    with pytest.raises(StartupError, match=r"within store.connect_timeout \(0 s\)"):
        wait(clock, refused_until(clock, 1.0), timeout=0.0)
    assert clock.slept == []


def test_a_refusal_of_what_the_url_names_ends_the_start_at_once() -> None:
    def refuses(url: str) -> None:
        raise BadStoreURL('store.url: the database server refuses it: database "tk" does not exist')

    with pytest.raises(BadStoreURL):
        wait(SteppingClock(), refuses)


def test_a_stop_during_the_wait_ends_it() -> None:
    stopping = asyncio.Event()

    class Stopped(SteppingClock):
        async def sleep(self, seconds: float) -> None:
            await super().sleep(seconds)
            if self.now > 10:
                stopping.set()  # a SIGTERM, as the loop's signal handler sets it

    clock = Stopped()
    tries: list[float] = []

    def try_once(url: str) -> None:
        tries.append(clock.now)
        raise NotAnswering("Connection refused")

    done, _ = wait(clock, try_once, stopping=stopping)
    assert done is False
    assert tries == [0.0, 0.5, 1.5, 3.5, 7.5]  # none after the stop


def test_sqlite_is_never_waited_for() -> None:
    async def main() -> bool:
        return await wait_for_database(
            "sqlite:////nonexistent/dir/tk.db", 120.0, Heard(), asyncio.Event()
        )

    assert asyncio.run(main()) is True
    probe("sqlite:////nonexistent/dir/tk.db")  # nothing to try: the store says what is wrong


def test_a_port_that_refuses_is_not_answering_and_waited_for() -> None:
    """The real drivers, on a port of this machine that nobody listens on."""
    import socket

    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = bound.getsockname()[1]
        for url in (f"postgresql://tk@127.0.0.1:{port}/tk", f"mysql://tk@127.0.0.1:{port}/tk"):
            with pytest.raises(NotAnswering, match=r"(?i)refused"):
                probe(url)
