"""A session runner reads its session's log once, then only what was committed after it.

A real store on a SQLite file and real session runners in one event loop, with the echo
model; `store.events.read` is wrapped to record where each read starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from supervisor.store import EventRecord, Store
from workers.agents.tool_loop import ToolLoopAgent
from workers.cache import HistoryCache, SessionLog
from workers.history import to_messages
from workers.models import SILENT, EchoModel, Message, ModelResponse, Stream, ToolSpec
from workers.prefetch import Prefetch
from workers.runner import SessionRunner
from workers.tools import BuiltinTools

GUARD = 60.0  # seconds: only so that a broken runner fails the test instead of hanging it


class Reads(list[tuple[str, int]]):
    """(session, after) of every `store.events.read`, in order."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        read = store.events.read

        def recording(session_id: str, after: int = 0, limit: int = 100) -> list[EventRecord]:
            self.append((session_id, after))
            return read(session_id, after, limit)

        monkeypatch.setattr(store.events, "read", recording)

    def of(self, session_id: str) -> list[int]:
        return [after for sid, after in self if sid == session_id]


class Seen(EchoModel):
    """The echo model, keeping the messages of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[Message]] = []

    async def complete(
        self, messages: list[Message], tools: list[ToolSpec], stream: Stream = SILENT
    ) -> ModelResponse:
        self.calls.append(list(messages))
        return await super().complete(messages, tools, stream)


class Session:
    """One leased session and its runner."""

    def __init__(self, store: Store, history: HistoryCache, model: EchoModel) -> None:
        self.store = store
        self.id = store.sessions.create("alice").id
        lease = store.leases.acquire(self.id, "w0", 300.0)
        assert lease is not None
        self.ended = asyncio.Event()
        self.after_turn: Callable[[], None] = lambda: None  # run inside the runner's task
        self.runner = SessionRunner(
            self.id,
            lease.token,
            "new",
            store=store,
            make_agent=lambda name: ToolLoopAgent(),
            model=model,
            toolbox=BuiltinTools(),
            notify=self.notify,
            served=self.served,
            history=history,
        )
        self.runner.start()

    def served(self) -> None:
        self.after_turn()
        self.after_turn = lambda: None
        self.ended.set()

    def reassign(self) -> None:
        """What the pool does on a reassignment: a new lease token, then `assign`."""
        lease = self.store.leases.acquire(self.id, "w0", 300.0, force=True)
        assert lease is not None
        self.runner.reassign(lease.token, "new")

    async def notify(self, type: str, **fields: Any) -> None:
        pass

    async def turn(self, text: str) -> int:
        """Inject `text` as intake does and wait for the turn to end; its `read_to`."""
        self.ended.clear()
        await asyncio.to_thread(
            self.store.events.append, self.id, "user_message", {"text": text}, writer="intake"
        )
        self.runner.wake()
        await asyncio.wait_for(self.ended.wait(), GUARD)
        events = self.store.events.tail(self.id, 50)
        started = [e for e in events if e.type == "turn_started"][-1]
        return int(started.payload["read_to"])

    async def stop(self) -> None:
        self.runner.release()
        assert self.runner.task is not None
        await asyncio.wait_for(self.runner.task, GUARD)


def test_each_turn_reads_only_after_the_seq_it_had(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads, model, history = Reads(store, monkeypatch), Seen(), HistoryCache()

    async def go() -> list[int]:
        session = Session(store, history, model)
        read_tos = [await session.turn(text) for text in ("one", '/tool echo {"x": 1}', "three")]
        await session.stop()
        return read_tos

    read_tos = asyncio.run(go())
    sid = store.sessions.list()[0].id
    # The first turn reads the whole log; each later one from where the last read stopped.
    assert reads.of(sid) == [0, *read_tos[:-1]]
    assert read_tos[0] < read_tos[1] < read_tos[2]
    # What the model was shown is what a rebuild of the log up to the turn's read gives.
    events = store.events.read(sid, 0, 1000)
    firsts = [calls for calls in model.calls if calls[-1].role == "user"]
    assert len(firsts) == 3
    for shown, read_to in zip(firsts, read_tos, strict=True):
        assert shown == to_messages(e for e in events if e.seq <= read_to)
    assert sid not in history  # a released runner leaves no log behind


def test_an_evicted_session_is_read_whole_at_its_next_turn(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads, history = Reads(store, monkeypatch), HistoryCache(budget=1)  # one log at most

    async def go() -> tuple[str, str]:
        a, b = Session(store, history, EchoModel()), Session(store, history, EchoModel())
        await a.turn("a1")
        await a.turn("a2")  # a's log is kept while it is the only one
        assert a.id in history
        await b.turn("b1")  # b's read goes past the budget: a, idle, is evicted
        assert a.id not in history and b.id in history
        await a.turn("a3")
        await a.stop()
        await b.stop()
        return a.id, b.id

    a, b = asyncio.run(go())
    first, second, third = reads.of(a)
    assert first == 0 and second > 0
    assert third == 0  # read whole again
    assert reads.of(b) == [0]


def test_a_new_token_or_a_new_runner_reads_the_whole_log(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads, history = Reads(store, monkeypatch), HistoryCache()

    async def go() -> str:
        session = Session(store, history, EchoModel())
        await session.turn("one")
        # Reassigned as the turn ends, before the runner reads the session row again (an
        # assignment that lands while that read is in flight is a race of its own).
        session.after_turn = session.reassign
        await session.turn("two")
        assert session.id not in history
        await session.turn("three")
        await session.stop()
        # A log left in the cache, even of the same token, is not trusted by a new runner.
        lease = store.leases.acquire(session.id, "w0", 300.0, force=True)
        assert lease is not None
        history.put(session.id, SessionLog(store.events.tail(session.id, 1000), lease.token))
        again = Session.__new__(Session)
        again.store, again.id, again.ended = store, session.id, asyncio.Event()
        again.runner = SessionRunner(
            session.id,
            lease.token,
            "new",
            store=store,
            make_agent=lambda name: ToolLoopAgent(),
            model=EchoModel(),
            toolbox=BuiltinTools(),
            notify=session.notify,
            served=again.ended.set,
            history=history,
        )
        assert session.id not in history
        again.runner.start()
        await again.turn("four")
        await again.stop()
        return session.id

    sid = asyncio.run(go())
    afters = reads.of(sid)
    assert afters[0] == 0 and afters[1] > 0
    assert afters[2:] == [0, 0]  # after the reassignment; by the new runner


def test_the_sessions_of_one_assign_are_read_together_then_each_goes_on(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead worker's sessions come in one `assign`: their rows and logs are read in one
    query each (`workers.prefetch`), not three per session, and each turn goes on from
    that read; a runner whose token moved on since reads alone."""
    reads, history = Reads(store, monkeypatch), HistoryCache()
    calls: dict[str, list[Any]] = {"get": [], "last_of": [], "opening": [], "logs": []}
    for obj, name in (
        (store.sessions, "get"),
        (store.events, "last_of"),
        (store.sessions, "opening"),
        (store.events, "logs"),
    ):
        real = getattr(obj, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls[_name].append(args[0])
            return _real(*args)

        monkeypatch.setattr(obj, name, spy)
    ids, tokens, ended = [], {}, asyncio.Event()
    for n in range(12):
        sid = store.sessions.create("alice").id
        store.events.append(sid, "user_message", {"text": f"hello {n}"}, writer="intake")
        lease = store.leases.acquire(sid, "w0", 300.0)
        assert lease is not None
        store.events.append(sid, "turn_started", {"read_to": 1}, turn_id=f"t{n}", token=lease.token)
        lease = store.leases.acquire(sid, "w1", 300.0, force=True)  # the dead worker's, taken
        assert lease is not None
        ids.append(sid)
        tokens[sid] = lease.token

    async def notify(type: str, **fields: Any) -> None:
        pass

    def served() -> int:  # turns ended
        return sum(1 for info in store.sessions.many(ids).values() if not info.active_turn_id)

    async def go() -> None:
        batch = Prefetch(store)
        runners = []
        for sid in ids:
            batch.add(sid, tokens[sid])
            runner = SessionRunner(
                sid,
                tokens[sid],
                "adopt",
                cause="worker_crash",
                store=store,
                make_agent=lambda name: ToolLoopAgent(),
                model=EchoModel(),
                toolbox=BuiltinTools(),
                notify=notify,
                served=ended.set,
                history=history,
                prefetch=batch,
            )
            runners.append(runner)
        lease = store.leases.acquire(ids[-1], "w1", 300.0, force=True)  # moved on: alone
        assert lease is not None
        runners[-1].reassign(lease.token, "adopt", "worker_crash")
        for runner in runners:
            runner.start()
        batch.start()  # once the whole message is assigned, as the worker does
        while served() < len(ids):
            ended.clear()
            await asyncio.wait_for(ended.wait(), GUARD)
        for runner in runners:
            runner.release()
            assert runner.task is not None
            await asyncio.wait_for(runner.task, GUARD)

    asyncio.run(go())
    assert calls["opening"] == [ids] and calls["logs"] == [{sid: 0 for sid in ids}]
    # Only the runner whose token moved on read its log whole, and its first row alone;
    # the others read their rows again only once their turns had ended.
    assert calls["last_of"] == [ids[-1]]
    assert [sid for sid, after in reads if after == 0] == [ids[-1]]
    rows = [calls["get"].count(sid) for sid in ids]  # its first row: one read more
    assert rows == [rows[0]] * (len(ids) - 1) + [rows[0] + 1]
    for n, sid in enumerate(ids):
        events = store.events.read(sid, 0, 100)
        assert [e.type for e in events][2:] == [
            "continuation",
            "model_response",
            "turn_ended",
        ]
        assert events[2].payload["cause"] == "worker_crash"
        assert events[3].payload["text"] == f"echo: hello {n}"
