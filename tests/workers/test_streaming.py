"""A turn's live output (`workers.streaming`): how streamed text is cut into deltas.

The coalescer is pure: the tests hand it the time. `LiveOutput` runs on a fake clock that
the test moves, so no test sleeps or races the machine.
"""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import given
from hypothesis import strategies as st

from supervisor.contract.control import DELTA_INTERVAL
from tests.clock import FakeClock
from workers.streaming import Coalescer, LiveOutput, Piece


def joined(pieces: list[Piece]) -> str:
    return "".join(piece.text for piece in pieces)


def test_the_first_piece_goes_at_once_with_the_time_since_the_call_began() -> None:
    coalescer = Coalescer()
    coalescer.begin(10.0)
    assert coalescer.text("Hello", 10.25) == [Piece(0, "Hello", None, 0.25)]


def test_text_within_the_interval_waits_and_goes_whole_when_it_is_due() -> None:
    coalescer = Coalescer(interval=0.05)
    coalescer.begin(0.0)
    coalescer.text("a", 0.0)
    assert coalescer.text(" b", 0.01) == []
    assert coalescer.text(" c", 0.02) == []
    assert coalescer.due() == 0.05
    assert coalescer.tick(0.049) == []
    assert coalescer.tick(0.05) == [Piece(1, " b c", None, 0.05)]
    assert coalescer.due() is None


def test_a_tool_call_is_a_piece_of_its_own_in_order() -> None:
    coalescer = Coalescer(interval=0.05)
    coalescer.begin(0.0)
    first = coalescer.text("let me look", 0.0)
    coalescer.tool_call("search", 0.01)
    coalescer.text(" more", 0.02)
    rest = [*coalescer.tick(0.05), *coalescer.tick(0.10)]
    assert [(p.text, p.tool_call) for p in first + rest] == [
        ("let me look", None),
        ("", "search"),
        (" more", None),
    ]


def test_text_past_the_limit_goes_in_the_next_pieces() -> None:
    coalescer = Coalescer(interval=0.05, limit=4)
    coalescer.begin(0.0)
    pieces = coalescer.text("abcdefghij", 0.0)
    pieces += coalescer.tick(0.05) + coalescer.tick(0.10)
    assert [p.text for p in pieces] == ["abcd", "efgh", "ij"]
    assert coalescer.due() is None


def test_finish_sends_all_that_waits_so_the_pieces_join_to_the_answer() -> None:
    coalescer = Coalescer(interval=0.05, limit=3)
    coalescer.begin(0.0)
    pieces = coalescer.text("one", 0.0) + coalescer.text(" two three", 0.01)
    pieces += coalescer.finish(0.02)
    assert joined(pieces) == "one two three" == coalescer.streamed
    assert [p.index for p in pieces] == list(range(len(pieces)))


def test_the_index_counts_across_the_model_calls_of_a_turn() -> None:
    coalescer = Coalescer()
    coalescer.begin(0.0)
    coalescer.tool_call("search", 0.1)
    coalescer.begin(1.0)
    assert coalescer.streamed == ""
    assert coalescer.text("found", 1.5) == [Piece(1, "found", None, 0.5)]


@given(
    st.lists(
        st.tuples(st.floats(0.0, 0.2), st.text(max_size=20), st.booleans()),
        max_size=40,
    )
)
def test_at_most_one_piece_an_interval_until_finish_and_nothing_lost(
    steps: list[tuple[float, str, bool]],
) -> None:
    coalescer = Coalescer(interval=DELTA_INTERVAL, limit=8)
    coalescer.begin(0.0)
    now, sent, streamed = 0.0, [], ""
    times: list[float] = []
    for gap, text, is_call in steps:
        now += gap
        out = coalescer.tick(now)
        out += coalescer.tool_call("t", now) if is_call else coalescer.text(text, now)
        streamed += "" if is_call else text
        sent += out
        times += [now] * len(out)
    assert all(b - a >= DELTA_INTERVAL - 1e-9 for a, b in itertools.pairwise(times))
    assert all(len(p.text) <= 8 for p in sent)
    sent += coalescer.finish(now)
    assert joined(sent) == streamed
    assert [p.index for p in sent] == list(range(len(sent)))
    assert sum(p.tool_call == "t" for p in sent) == sum(step[2] for step in steps)


def test_live_output_sends_waiting_text_when_it_is_due_with_no_more_coming() -> None:
    async def scenario() -> list[Piece]:
        clock = FakeClock(start=0.0)
        sent: list[Piece] = []
        live = LiveOutput(lambda piece: sent.append(piece) is None, clock)
        live.begin()
        live.text("a")
        live.text(" b")
        await asyncio.sleep(0)
        assert [p.text for p in sent] == ["a"]
        await clock.advance(DELTA_INTERVAL)
        return sent

    assert [p.text for p in asyncio.run(scenario())] == ["a", " b"]


def test_a_piece_the_queue_refuses_is_dropped_counted_and_its_index_spent() -> None:
    async def scenario() -> tuple[LiveOutput, list[Piece]]:
        clock = FakeClock(start=0.0)
        sent: list[Piece] = []
        full = iter([True, False, True])

        def send(piece: Piece) -> bool:
            ok = next(full)
            if ok:
                sent.append(piece)
            return ok

        live = LiveOutput(send, clock)
        live.begin()
        live.text("one")
        live.tool_call("search")
        await clock.advance(DELTA_INTERVAL)
        live.text(" two")
        live.finish()
        return live, sent

    live, sent = asyncio.run(scenario())
    assert (live.sent, live.dropped) == (2, 1)
    assert [(p.index, p.text) for p in sent] == [(0, "one"), (2, " two")]
