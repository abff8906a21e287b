"""The listener's exception handler (issue 32), in process: asyncio's report of an accept
out of descriptors becomes one line a minute with the count since the last, and nothing
else is kept from the handler that was there before (the real daemon's case is
tests/lifecycle/test_descriptors.py)."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

from loguru import logger

from supervisor.http.listener import STARVED_MESSAGE, Starvation


def starved(code: int = errno.EMFILE) -> dict[str, Any]:
    """What asyncio's `_accept_connection` hands the exception handler."""
    return {"message": STARVED_MESSAGE, "exception": OSError(code, "Too many open files")}


def test_only_an_accept_out_of_resources_is_kept_from_the_previous_handler() -> None:
    passed: list[dict[str, Any]] = []
    handler = Starvation(lambda loop, context: passed.append(context))
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m).rstrip()), level="DEBUG", format="{message}")
    loop = asyncio.new_event_loop()
    try:
        other = {"message": "Task exception was never retrieved", "exception": RuntimeError()}
        refused = {"message": STARVED_MESSAGE, "exception": ConnectionAbortedError()}
        handler(loop, other)
        for _ in range(500):
            handler(loop, starved())
        handler(loop, refused)
        handler(loop, starved(errno.ENOBUFS))
    finally:
        loop.close()
        logger.remove(sink)
    assert passed == [other, refused]
    # Told once (the first); the rest wait for the next line a minute later.
    assert len(lines) == 1, lines
    assert lines[0].startswith("out of file descriptors accepting connections (EMFILE")
    assert handler.tally.pending == 500


def test_the_next_line_a_minute_later_says_how_many_times_since() -> None:
    handler = Starvation(None)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m).rstrip()), level="DEBUG", format="{message}")
    try:
        error = starved()["exception"]
        handler.note(error, 100.0)
        for second in range(1, 60):
            handler.note(error, 100.0 + second)
        handler.note(error, 160.0)
        handler.note(error, 161.0)
    finally:
        logger.remove(sink)
    assert len(lines) == 2, lines
    assert "since the last line" not in lines[0]
    assert "EMFILE: Too many open files), 60 times since the last line" in lines[1]
