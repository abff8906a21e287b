"""An attach stream on one host shows, live, what another host commits.

Two daemons (`host-a`, `host-b`) share one PostgreSQL schema (or MySQL database), each
with its own state dir and admin token, and one tokens file naming alice. The session is
created on A, whose worker owns it; every message is injected on A, so B's supervisor
hears of none of its commits and its stream can only follow the database. The stream on
B must give every event once, in seq order, with no gap, while the turns run: one turn is
held in flight (`/gate`) while B shows its start, then several turns follow, each sent
right after B showed the last one end, then a burst of messages at once.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import statistics
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import peewee
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.http import attach
from supervisor.http.attach import Hub
from supervisor.http.auth import digest
from supervisor.http.follow import Follow
from supervisor.http.pages import sse_body
from supervisor.store import Store
from supervisor.store.reading import EventRow
from tests.clock import FakeClock
from tests.conftest import CLUSTER_WAIT
from tests.daemon import Daemon, daemons, events, turn_ended, wait_until
from tests.http.test_replay_gate import sse_events
from tests.support import plain

__all__ = ["daemons"]  # the fixture

WAIT_S = 30.0  # a bound on waiting for what must happen, not a measure of speed
TURNS = 5
BURST = 4
# The median time from an inject's answer on A to its event on B's stream. Following
# the database every `attach.IDLE_CHECK` (0.25 s) gives about that; a stream that read
# the log again only after 2 s without a signal would give nearly 2 s here, since each
# inject comes right after B showed the previous turn end.
LIVE_S = 1.0
POOL = {"workers": 1, "spare": 0, "heartbeat_interval": 0.2, "hang_timeout": 5.0}


@dataclass(frozen=True)
class Seen:
    """One event of an attach stream, and when it arrived (monotonic seconds)."""

    id: int  # its `id:` line
    seq: int
    type: str
    data: dict[str, Any]
    at: float


def http(daemon: Daemon, token: str) -> httpx.Client:
    """A client of `daemon`'s API on its unix socket, sending `token`."""
    return httpx.Client(
        transport=plain(daemon.listen.removeprefix("unix:")),
        base_url="http://turnkeeper",
        headers={"Authorization": f"Bearer {token}"},
        timeout=15,
        trust_env=False,
    )


class Stream:
    """An attach stream read on its own thread; each event is queued as it arrives."""

    def __init__(self, client: httpx.Client, session_id: str) -> None:
        self.seen: list[Seen] = []
        self._events: queue.Queue[Seen] = queue.Queue()
        self._socket: socket.socket | None = None
        self.opened = threading.Event()
        self.ended = threading.Event()
        url = f"/v1/sessions/{session_id}/attach"
        threading.Thread(target=self._read, args=(client, url), daemon=True).start()
        assert self.opened.wait(WAIT_S), "the attach stream did not open"
        assert self._socket is not None, "the attach stream was refused"

    def _read(self, client: httpx.Client, url: str) -> None:
        try:
            with client.stream("GET", url, timeout=httpx.Timeout(15, read=None)) as response:
                if response.status_code == 200:
                    self._socket = response.extensions["network_stream"].get_extra_info("socket")
                self.opened.set()
                fields: dict[str, str] = {}
                for line in response.iter_lines():
                    if line:
                        if not line.startswith(":"):
                            name, _, value = line.partition(":")
                            fields[name] = value.removeprefix(" ")
                        continue
                    if fields and fields.get("event") != "delta":  # deltas are no events
                        data = json.loads(fields["data"])
                        seen = Seen(
                            int(fields["id"]), data["seq"], data["type"], data, time.monotonic()
                        )
                        self._events.put(seen)
                    fields = {}
        except httpx.HTTPError:
            pass  # also how close() ends it
        finally:
            self.opened.set()
            self.ended.set()

    def until(self, kind: str) -> list[Seen]:
        """The events up to and including the next one of type `kind`."""
        return self._take(lambda got: got[-1].type == kind, f"a {kind} event")

    def through(self, seq: int) -> list[Seen]:
        """The events up to and including seq `seq`."""
        return self._take(lambda got: got[-1].seq >= seq, f"seq {seq}")

    def _take(self, done: Callable[[list[Seen]], bool], what: str) -> list[Seen]:
        deadline = time.monotonic() + WAIT_S
        got: list[Seen] = []
        while not got or not done(got):
            try:
                got.append(self._events.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"B's attach stream gave no {what} in time (ended: {self.ended})")
        self.seen += got
        return got

    def close(self) -> None:
        if self._socket is not None:
            self._socket.shutdown(socket.SHUT_RDWR)
        assert self.ended.wait(WAIT_S), "the attach thread did not end"


def inject(client: httpx.Client, session_id: str, text: str) -> int:
    answer = client.post(f"/v1/sessions/{session_id}/inject", json={"text": text})
    assert answer.status_code == 202, answer.text
    seq: int = answer.json()["seq"]
    return seq


def settled(store: Store, session_id: str) -> int | None:
    """The session's last seq once no message waits and no turn runs."""
    info = store.sessions.get(session_id)
    return None if info.pending or info.active_turn_id else info.last_seq


@pytest.mark.usefixtures("cluster_turn")  # one cluster at a time (conftest.CLUSTER_LOCK)
@pytest.mark.xdist_group("cluster")
@pytest.mark.timeout(120 + CLUSTER_WAIT)
@pytest.mark.parametrize("db_url", ["postgresql", "mysql"], indirect=True)
def test_a_stream_on_b_shows_what_a_commits_live_gapless_in_order(
    db_url: str, daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    alice = f"alice-{uuid.uuid4().hex}"
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"alice sha256:{digest(alice)}\n")
    tokens_file.chmod(0o600)

    def host(name: str) -> Daemon:
        return daemons(
            daemon={"host_id": name},
            store={"url": db_url},
            auth={"tokens_file": str(tokens_file)},
            pool=POOL,
        ).start()

    a = host("host-a")
    on_a = http(a, alice)
    created = on_a.post("/v1/sessions", json={"title": "across hosts"})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    with Store(db_url, migrate=False) as store:
        assert inject(on_a, sid, "first") == 1
        wait_until(lambda: turn_ended(store, sid), WAIT_S, "the first turn to end on A")
        owner = store.sessions.get(sid).owner
        assert owner is not None and owner.startswith("host-a/"), owner

        b = host("host-b")
        # Principals and ACLs are in the database: B's admin and alice read A's session.
        admin_b = http(b, (b.state / "admin.token").read_text().strip())
        assert admin_b.get(f"/v1/sessions/{sid}").status_code == 200
        on_b = http(b, alice)
        assert on_b.get(f"/v1/sessions/{sid}").json()["last_seq"] == 4

        stream = Stream(on_b, sid)
        assert [e.seq for e in stream.until("turn_ended")] == [1, 2, 3, 4]  # the replay

        # A turn held in flight on A: B shows its start while it runs.
        gate = tmp_path / "gate"
        held = inject(on_a, sid, f"/gate {gate} held")
        started = stream.until("turn_started")
        assert started[-1].seq > held
        assert turn_ended(store, sid, held) is None, "the held turn ended before the gate opened"
        gate.touch()
        stream.until("turn_ended")

        # Turns one after another, each sent right after B showed the last one end.
        delays = []
        for n in range(TURNS):
            seq = inject(on_a, sid, f"turn {n}")
            answered = time.monotonic()
            got = stream.until("turn_ended")
            assert got[0].seq == seq and got[0].data["payload"]["text"] == f"turn {n}"
            delays.append(got[0].at - answered)

        # A burst while turns run; then everything, once, in order.
        for n in range(BURST):
            inject(on_a, sid, f"burst {n}")
        last = wait_until(lambda: settled(store, sid), WAIT_S, "the burst's turns to end")
        stream.through(last)
        stored = events(store, sid)
        assert store.sessions.get(sid).owner == owner, "the session changed hands"

    assert [e.seq for e in stream.seen] == list(range(1, last + 1))
    assert [e.id for e in stream.seen] == [e.seq for e in stream.seen]
    assert [e.data for e in stream.seen] == on_b.get(
        f"/v1/sessions/{sid}/events", params={"limit": 1000}
    ).json()["events"]
    assert [(e.type, e.data["payload"]) for e in stream.seen] == [
        (s.type, s.payload) for s in stored
    ]
    answers = [e.data["payload"]["text"] for e in stream.seen if e.type == "model_response"]
    assert answers[-1].startswith("echo: burst")
    assert statistics.median(delays) < LIVE_S, delays
    stream.close()
    for client in (on_a, on_b, admin_b):
        client.close()


# --- the rules of following, without processes or a database --------------------------------


def test_follow_reads_attached_sessions_and_signals_only_news() -> None:
    follow = Follow()
    assert follow.due() == []  # nothing attached: nothing to read
    follow.attach("s")
    follow.attach("t")
    assert follow.due() == ["s", "t"]
    assert follow.heads({"s": 3, "t": 0}) == [("s", 3)]
    assert follow.heads({"s": 3, "t": 0}) == []  # read twice: no news
    follow.published("s", 5)  # a local publish past what was signalled
    assert follow.due() == ["t"]  # its streams read to the end at that signal
    assert follow.due() == ["s", "t"]  # the tick after: read again
    assert follow.heads({"s": 4}) == []  # behind what the publish signalled
    follow.published("s", 2)  # a late publish is no news and skips no read
    assert follow.due() == ["s", "t"]
    follow.detach("s")
    follow.published("s", 9)
    assert follow.heads({"s": 9, "t": 1}) == [("t", 1)]  # a read that ended after a detach
    follow.attach("s")  # attached again: its streams replay, then every head is news
    assert follow.heads({"s": 9}) == [("s", 9)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=80))
def test_every_stream_catches_up_whoever_commits_and_whenever_signals_arrive(
    steps: list[int],
) -> None:
    """A model of the hub on one session. Commits are this host's (published, maybe late
    and in any order) or another's (never published); streams subscribe, replay and take
    their signals whenever; reads of the head start at a tick and end later. However
    that interleaves, after the publishes and one quiet tick every stream has the log."""
    follow = Follow()
    follow.attach("s")
    head = 0
    unpublished: list[int] = []
    streams: list[tuple[list[int], list[int | None]]] = [([], [0])]  # (signals, [last])
    reading: list[int] = []  # heads read by a tick, not yet handed to `heads`

    def signal(seq: int) -> None:
        for queued, _ in streams:
            queued.append(seq)

    def take(queued: list[int], last: list[int | None]) -> None:
        seq = queued.pop(0)
        if last[0] is not None and seq > last[0]:
            last[0] = head  # reads the log to its end after the last seq it sent

    def tick() -> None:
        if "s" in follow.due():
            reading.append(head)

    def read_ends() -> None:
        for _, seq in follow.heads({"s": reading.pop(0)}):
            signal(seq)

    for step in steps:
        if step == 0:  # a commit of this host's worker or intake: published later
            head += 1
            unpublished.append(head)
        elif step == 1:  # a commit of another host
            head += 1
        elif step == 2 and unpublished:  # a publish arrives, not necessarily in order
            seq = unpublished.pop(len(unpublished) // 2)
            follow.published("s", seq)
            signal(seq)
        elif step == 3:
            tick()
        elif step == 4 and reading:
            read_ends()
        elif step == 5:  # a stream subscribes; its replay comes later
            streams.append(([], [None]))
        elif step == 6:  # the oldest replay still to run reads the log to its end
            for _, last in streams:
                if last[0] is None:
                    last[0] = head
                    break
        else:  # every stream takes the signals waiting for it
            for queued, last in streams:
                while queued:
                    take(queued, last)

    for _, last in streams:
        if last[0] is None:
            last[0] = head
    for seq in unpublished:
        follow.published("s", seq)
        signal(seq)
    while reading:
        read_ends()
    for _ in range(2):  # a tick skipped for a publish, then a quiet one
        tick()
        while reading:
            read_ends()
        for queued, last in streams:
            while queued:
                take(queued, last)
    assert [last[0] for _, last in streams] == [head] * len(streams)


# --- a stream with an in-memory log: every event once, in order -----------------------------


class Log:
    """One session's log in memory, read as `pages.Pages.sse` reads it; a read can be made
    to fail, as when the database is down."""

    def __init__(self) -> None:
        self.rows: list[EventRow] = []
        self.failures = 0  # the next reads (of pages and of heads) that fail
        self.head_reads: queue.Queue[bool] = queue.Queue()  # each read of heads: whether it failed

    def append(self, count: int = 1) -> int:
        for _ in range(count):
            seq = len(self.rows) + 1
            self.rows.append((seq, "model_response", None, json.dumps({"n": seq}), 0.0))
        return len(self.rows)

    def _fail(self) -> None:
        if self.failures:
            self.failures -= 1
            raise peewee.OperationalError("the database is down")

    async def read(self, session_id: str, after: int, limit: int) -> tuple[bytes, int, bool]:
        self._fail()
        rows = self.rows[after : after + limit]
        if not rows:
            return b"", after, False
        return sse_body(rows), rows[-1][0], len(rows) == limit

    def heads(self, session_ids: Sequence[str]) -> dict[str, int]:
        try:
            self._fail()
        except peewee.OperationalError:
            self.head_reads.put(True)
            raise
        self.head_reads.put(False)
        return {session_id: len(self.rows) for session_id in session_ids}


async def stream_scenario() -> None:
    clock = FakeClock()
    hub = Hub(clock)
    log = Log()
    hub.follow(log.heads)

    async def handler(request: web.Request) -> web.StreamResponse:
        return await attach.stream(request, "s", 0, hub, log.read)

    app = web.Application()
    app.router.add_get("/attach", handler)
    seqs: list[int] = []

    async def next_seq(events: AsyncIterator[dict[str, Any]]) -> int:
        seqs.append((await asyncio.wait_for(anext(events), WAIT_S))["seq"])
        return seqs[-1]

    async def asleep() -> None:
        wait_s = time.monotonic() + WAIT_S
        while clock.sleepers != 1:
            assert time.monotonic() < wait_s, "the follower is not waiting for its tick"
            await asyncio.sleep(0.01)

    async def tick() -> bool | None:
        """Wake the follower (asleep on the clock); whether its read of heads failed, or
        None if it read nothing."""
        await asleep()
        await clock.advance(attach.IDLE_CHECK)
        await asleep()  # again, once its read is done
        return None if log.head_reads.empty() else log.head_reads.get_nowait()

    log.append(3)
    async with TestClient(TestServer(app)) as client:
        assert clock.sleepers == 0  # no stream: no follower
        response = await client.get("/attach")
        events = sse_events(response)
        assert [await next_seq(events) for _ in range(3)] == [1, 2, 3]  # the replay
        await asleep()  # one follower

        # A local publish past last + 1: the gap is read from the log first.
        log.append(2)
        hub.publish("s", {"seq": 5, "type": "model_response"})
        assert [await next_seq(events) for _ in range(2)] == [4, 5]
        hub.publish("s", {"seq": 4, "type": "model_response"})  # late: nothing new
        assert await tick() is None  # the stream read the log at that publish

        # Another host's commit: the follower reads the head at its next tick.
        log.append()
        assert await tick() is False
        assert await next_seq(events) == 6

        # The head read fails: logged, the follower lives and reads at the next tick.
        log.append()
        log.failures = 1
        assert await tick() is True
        assert await tick() is False
        assert await next_seq(events) == 7

        # The stream's own read fails: it stays open, behind, and reads again by itself.
        log.append(2)
        log.failures = 1
        hub.publish("s", {"seq": 9, "type": "model_response"})
        assert [await next_seq(events) for _ in range(2)] == [8, 9]

        # The client leaves: the stream ends, and with it the follower.
        response.close()
        wait_s = time.monotonic() + WAIT_S
        while hub.streams and time.monotonic() < wait_s:
            await asyncio.sleep(0.05)
        assert hub.streams == 0
        await asyncio.sleep(0)  # the cancelled follower ends
        await clock.advance(attach.IDLE_CHECK)
        assert clock.sleepers == 0 and log.head_reads.empty()
    assert seqs == list(range(1, 10))  # once each, in order


def test_a_stream_sends_each_event_once_in_order_whoever_signals_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attach, "CLIENT_CHECK", 0.1)  # notice the client leaving soon
    asyncio.run(stream_scenario())
