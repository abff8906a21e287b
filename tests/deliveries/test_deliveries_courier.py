"""The courier in-process, on a real store, against targets an `httpx.MockTransport` plays:
a session's deliveries arrive in seq order whatever fails, a down target holds back only
its own, what each answer means (4xx dead at once, 408/429/5xx/no answer retried, dead
once `max_age` old or after a positive `max_attempts`, retried by an operator), the signed
request, the claims given back on a stop, the signals that wake it, and its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from supervisor.contract.clock import SYSTEM, Clock, SystemClock
from supervisor.contract.config import Config
from supervisor.core.vocabulary import AttemptOutcome
from supervisor.deliveries.rules import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
from supervisor.deliveries.service import Courier
from supervisor.metrics import Metrics
from supervisor.runtime.loops import SLACK
from supervisor.store import DeliveryInfo, Outgoing, Store
from tests.clock import FakeClock
from tests.conftest import BACKENDS

OWNER = "host-t/boot0001"
SECRETS = {"HOOK": "TK_TEST_HOOK_SECRET", "DOWN": "TK_TEST_DOWN_SECRET"}
TIMEOUT = 60.0  # a target's: longer than any test, whose hanging attempts end by a gate
WAIT = 60.0  # seconds a test waits for the courier at most


@pytest.fixture(autouse=True)
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, env in SECRETS.items():
        monkeypatch.setenv(env, f"secret of {name.lower()}")


def config(**delivery: Any) -> Config:
    targets = [
        {"name": name.lower(), "url": f"http://{name.lower()}.test/in", "secret_env": env,
         "timeout": TIMEOUT}
        for name, env in SECRETS.items()
    ]  # fmt: skip
    settings = {"poll_interval": 0.01, "backoff": 0.01, "backoff_cap": 0.02, "max_attempts": 3}
    return Config.model_validate({"delivery": settings | {"targets": targets} | delivery})


class Target:
    """The receivers: what each request carried, and what `answer` makes of it."""

    def __init__(self, answer: Callable[[httpx.Request, dict[str, Any], int], Any]) -> None:
        self.answer = answer  # (request, body, how many times this delivery came) -> ...
        self.requests: list[httpx.Request] = []
        self.seen: dict[str, int] = {}

    def seqs(self, session: str) -> list[int]:
        bodies = [json.loads(r.content) for r in self.requests]
        return [b["seq"] for b in bodies if b["session"] == session]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        body = json.loads(request.content)
        self.seen[body["delivery_id"]] = n = self.seen.get(body["delivery_id"], 0) + 1
        got = self.answer(request, body, n)
        if asyncio.iscoroutine(got):
            got = await got
        if isinstance(got, Exception):
            raise got
        return httpx.Response(got)


class Watch:
    """The attempts the courier finished, and a wait for what they add up to."""

    def __init__(self, courier: Courier) -> None:
        self.outcomes: list[tuple[str, AttemptOutcome]] = []
        self._changed = asyncio.Event()
        courier.on_finished.append(self._finished)

    def _finished(self, delivery_id: str, outcome: AttemptOutcome) -> None:
        self.outcomes.append((delivery_id, outcome))
        self._changed.set()

    def count(self, outcome: AttemptOutcome) -> int:
        return sum(1 for _, o in self.outcomes if o is outcome)

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT):
            while True:
                self._changed.clear()
                if done():
                    return
                await self._changed.wait()


def make(
    store: Store, target: Target, clock: Clock = SYSTEM, **delivery: Any
) -> tuple[Courier, Watch, Metrics]:
    metrics, mock = Metrics(), httpx.MockTransport(target)
    courier = Courier(
        config(**delivery), store, OWNER, metrics, clock=clock, jitter=lambda: 0.0, transport=mock
    )
    return courier, Watch(courier), metrics


@contextlib.asynccontextmanager
async def running(courier: Courier) -> AsyncIterator[None]:
    task = asyncio.create_task(courier.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def bound(store: Store, target: str = "hook", answers: int = 0) -> str:
    session_id = store.sessions.create("alice").id
    store.deliveries.bind(session_id, target, ["answer", "notice"])
    for n in range(answers):
        answer(store, session_id, f"answer {n + 1}")
    return session_id


def answer(store: Store, session_id: str, text: str) -> int:
    return store.events.append(session_id, "model_response", {"text": text, "tool_calls": []})


def rows(store: Store, session_id: str) -> list[DeliveryInfo]:
    return sorted(store.deliveries.list(session=session_id), key=lambda d: d.seq)


def attempts(metrics: Metrics) -> dict[Any, float | None]:
    get = metrics.registry.get_sample_value
    return {o: get("turnkeeper_delivery_attempts_total", {"outcome": o}) for o in AttemptOutcome}


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_session_s_deliveries_arrive_in_seq_order_through_failures(store: Store) -> None:
    def first_fails(request: httpx.Request, body: dict[str, Any], n: int) -> Any:
        if n == 1:
            return 503 if body["seq"] % 2 else httpx.ReadTimeout("slow", request=request)
        return 200

    target = Target(first_fails)
    one, two = bound(store, answers=3), bound(store, answers=3)

    async def main() -> None:
        courier, watch, metrics = make(store, target)
        async with running(courier):
            await watch.until(lambda: watch.count(AttemptOutcome.DELIVERED) >= 1)
            for text in ("late 1", "late 2"):  # committed while it runs
                seq = answer(store, one, text)
                courier.nudge(one, {"type": "model_response", "seq": seq})
            await watch.until(lambda: watch.count(AttemptOutcome.DELIVERED) == 8)
        assert attempts(metrics) == {"delivered": 8.0, "failed": 8.0, "dead": 0.0}
        assert metrics.registry.get_sample_value("turnkeeper_delivery_lag_seconds_count") == 8
        assert 'turnkeeper_deliveries{status="delivered"} 8.0' in metrics.render().decode()

    asyncio.run(main())
    assert target.seqs(one) == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert target.seqs(two) == [1, 1, 2, 2, 3, 3]
    for d in rows(store, one) + rows(store, two):
        assert (d.status, d.attempts, d.claimed_by, d.last_code) == ("delivered", 2, None, 200)
        assert d.delivered_at is not None and d.last_error == ""


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_target_that_fails_holds_back_only_its_own(store: Store) -> None:
    async def main() -> None:
        stuck, release = asyncio.Event(), asyncio.Event()

        async def hang() -> int:
            stuck.set()
            await release.wait()
            return 500

        def respond(request: httpx.Request, body: dict[str, Any], n: int) -> Any:
            if request.url.host == "hook.test":
                return 200
            tries = len(target.seqs(body["session"]))
            if tries == 1:
                return hang()
            return 500 if tries % 2 else httpx.ReadTimeout("slow", request=request)

        target = Target(respond)
        down, up = bound(store, "down", answers=2), bound(store, "hook", answers=3)
        courier, watch, _ = make(store, target)
        async with running(courier):
            await stuck.wait()
            await watch.until(lambda: watch.count(AttemptOutcome.DELIVERED) == 3)
            assert target.seqs(down) == [1]  # still in flight
            first = rows(store, down)[0]
            assert (first.status, first.attempts, first.claimed_by) == ("pending", 0, OWNER)
            release.set()
            await watch.until(lambda: watch.count(AttemptOutcome.DEAD) == 2)
        assert target.seqs(up) == [1, 2, 3] and target.seqs(down) == [1, 1, 1, 2, 2, 2]
        assert [(d.status, d.attempts) for d in rows(store, up)] == [("delivered", 1)] * 3
        one, two = rows(store, down)
        assert (one.status, one.attempts, one.last_code) == ("dead", 3, 500)
        given_up = "failed delivery.max_attempts (3) times"
        assert one.last_error == f"HTTP 500 Internal Server Error; {given_up}"
        assert (two.status, two.attempts, two.last_code) == ("dead", 3, None)
        assert two.last_error == f"no answer within {TIMEOUT} s; {given_up}"

    asyncio.run(main())


def test_what_each_answer_means(store: Store) -> None:
    script = {"refused": [404, 200], "busy": [429, 200], "slow": [408, 200], "bad": [400]}
    sessions = {name: bound(store, answers=2 if name == "refused" else 1) for name in script}
    names = {sid: name for name, sid in sessions.items()}

    def respond(request: httpx.Request, body: dict[str, Any], n: int) -> Any:
        return script[names[body["session"]]].pop(0)  # each session's answers in turn

    async def main() -> None:
        courier, watch, metrics = make(store, Target(respond))
        async with running(courier):
            await watch.until(lambda: len(watch.outcomes) == 7)
        assert attempts(metrics) == {"delivered": 3.0, "failed": 2.0, "dead": 2.0}

    asyncio.run(main())
    refused = rows(store, sessions["refused"])
    assert [(d.status, d.attempts, d.last_code) for d in refused] == [
        ("dead", 1, 404),  # at once: sending it again would not help
        ("delivered", 1, 200),  # a dead one is done: the next goes
    ]
    for name in ("busy", "slow"):
        [d] = rows(store, sessions[name])
        assert (d.status, d.attempts, d.last_code) == ("delivered", 2, 200)
    [bad] = rows(store, sessions["bad"])
    assert (bad.status, bad.attempts, bad.last_error) == ("dead", 1, "HTTP 400 Bad Request")


class Ahead(SystemClock):
    """The system's clock, its wall moved on by hand: how old a delivery looks."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def time(self) -> float:
        return super().time() + self.ahead


def test_with_no_attempt_limit_a_delivery_is_tried_until_max_age_then_dead(
    store: Store,
) -> None:
    target = Target(lambda request, body, n: 503)
    sid = bound(store, answers=1)
    clock = Ahead()

    async def main() -> None:
        courier, watch, metrics = make(store, target, clock, max_attempts=0, max_age=3600)
        async with running(courier):
            await watch.until(lambda: watch.count(AttemptOutcome.FAILED) >= 10)
            [d] = rows(store, sid)
            assert d.status == "pending"  # far past the 5 attempts of old
            clock.ahead = 3600.0  # an hour after its event: the next failure is its last
            await watch.until(lambda: watch.count(AttemptOutcome.DEAD) == 1)
        assert attempts(metrics)["failed"] == len(target.requests) - 1

    asyncio.run(main())
    [d] = rows(store, sid)
    assert (d.status, d.attempts, d.last_code) == ("dead", len(target.requests), 503)
    assert d.last_error == (
        "HTTP 503 Service Unavailable; not delivered within delivery.max_age (3600 s)"
    )


def test_the_last_attempt_is_made_at_the_deadline_not_a_backoff_later(store: Store) -> None:
    target = Target(lambda request, body, n: 503)
    sid = bound(store, answers=1)
    clock = Ahead()
    clock.ahead = 3599.0  # its first attempt a second before its deadline

    async def main() -> None:
        # A backoff past the test's patience: only the deadline brings the second attempt.
        courier, watch, _ = make(
            store, target, clock, max_attempts=0, max_age=3600, backoff=600, backoff_cap=600
        )
        async with running(courier):
            await watch.until(lambda: watch.count(AttemptOutcome.DEAD) == 1)

    asyncio.run(main())
    [d] = rows(store, sid)
    assert (d.status, d.attempts) == ("dead", 2)
    assert d.last_error.endswith("not delivered within delivery.max_age (3600 s)")


def test_dead_after_max_attempts_then_retried(store: Store) -> None:
    up = False
    target = Target(lambda request, body, n: 200 if up else 500)
    sid = bound(store, answers=1)

    async def main() -> None:
        nonlocal up
        courier, watch, metrics = make(store, target, max_attempts=4)
        async with running(courier):
            await watch.until(lambda: watch.count(AttemptOutcome.DEAD) == 1)
            [dead] = rows(store, sid)
            assert (dead.status, dead.attempts, dead.last_code) == ("dead", 4, 500)
            assert len(target.requests) == 4
            up = True
            retried = store.deliveries.retry(dead.id)
            assert retried is not None and (retried.status, retried.attempts) == ("pending", 0)
            courier.stir()
            await watch.until(lambda: watch.count(AttemptOutcome.DELIVERED) == 1)
        assert attempts(metrics) == {"delivered": 1.0, "failed": 3.0, "dead": 1.0}

    asyncio.run(main())
    [d] = rows(store, sid)
    assert (d.status, d.attempts, d.last_code) == ("delivered", 1, 200)
    assert {r.headers["Idempotency-Key"] for r in target.requests} == {d.id}  # one key


def test_the_request_is_signed_and_carries_the_event(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = Target(lambda request, body, n: 204)
    sid = bound(store)
    seq = answer(store, sid, "héllo, world")
    unsigned = bound(store, "down", answers=1)
    monkeypatch.delenv(SECRETS["DOWN"])  # unset since the start check: nothing is sent

    async def main() -> None:
        courier, watch, _ = make(store, target)
        async with running(courier):
            await watch.until(lambda: len(watch.outcomes) == 4)

    asyncio.run(main())
    [request] = target.requests
    [d] = rows(store, sid)
    [event] = store.events.read(sid)
    assert request.method == "POST" and str(request.url) == "http://hook.test/in"
    assert (d.status, d.last_code, request.headers["Idempotency-Key"]) == ("delivered", 204, d.id)
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["User-Agent"] == "turnkeeper-delivery"
    stamp = int(request.headers[TIMESTAMP_HEADER])
    signed = request.headers[SIGNATURE_HEADER]
    assert verify(b"secret of hook", stamp, request.content, signed, time.time(), 60)
    assert not verify(b"secret of down", stamp, request.content, signed, time.time(), 60)
    assert not verify(b"secret of hook", stamp, request.content + b" ", signed, time.time(), 60)
    fields = {"delivery_id": d.id, "session": sid, "seq": seq, "type": "answer"}
    fields |= {"text": "héllo, world", "created_at": event.created_at}
    assert json.loads(request.content) == fields  # exactly these
    [never] = rows(store, unsigned)
    assert (never.status, never.attempts, never.last_code) == ("dead", 3, None)
    assert never.last_error == (
        f"{SECRETS['DOWN']} is not set: nothing sent; failed delivery.max_attempts (3) times"
    )


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_stop_gives_the_claims_back(store: Store) -> None:
    async def main() -> None:
        stuck = asyncio.Event()

        async def hang() -> int:
            stuck.set()
            await asyncio.Event().wait()  # never answers
            return 200

        def respond(request: httpx.Request, body: dict[str, Any], n: int) -> Any:
            return hang() if request.url.host == "down.test" else 200

        target = Target(respond)
        held, done = bound(store, "down", answers=2), bound(store, answers=1)
        courier, watch, _ = make(store, target)
        async with running(courier):
            await stuck.wait()
            await watch.until(lambda: watch.count(AttemptOutcome.DELIVERED) == 1)
            assert rows(store, held)[0].claimed_by == OWNER
        first, second = rows(store, held)
        assert (first.status, first.attempts, first.claimed_by) == ("pending", 0, None)
        assert first.claim_expires_at is None and second.claimed_by is None
        assert rows(store, done)[0].status == "delivered"
        # Whoever claims next (another daemon, this host's next boot) sends it again.
        again = store.deliveries.claim("host-u/boot0001", {"down": 60.0}, 10)
        assert [o.delivery.id for o in again] == [first.id]

    asyncio.run(main())


def test_a_claim_in_flight_at_the_stop_is_given_back_too(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = bound(store, answers=1)
    claim, release = store.deliveries.claim, store.deliveries.release
    asked, gate, claimed = threading.Event(), threading.Event(), threading.Event()

    def held_claim(*args: Any) -> list[Outgoing]:
        asked.set()
        gate.wait(WAIT)
        found = claim(*args)
        claimed.set()
        return found

    def late_release(owner: str, *rest: float) -> int:
        released = release(owner, *rest)
        gate.set()  # a stop that did not wait for the claim: it commits after this
        return released

    monkeypatch.setattr(store.deliveries, "claim", held_claim)
    monkeypatch.setattr(store.deliveries, "release", late_release)

    async def main() -> None:
        courier, _, _ = make(store, Target(lambda request, body, n: 200))
        async with running(courier):
            await asyncio.to_thread(asked.wait, WAIT)
            # The stop waits for the claim: let it commit (the release opens it else).
            asyncio.get_running_loop().call_later(0.2, gate.set)
        await asyncio.to_thread(claimed.wait, WAIT)

    asyncio.run(main())
    [d] = rows(store, sid)
    assert (d.status, d.attempts, d.claimed_by) == ("pending", 0, None)


async def asleep(courier: Courier, clock: FakeClock) -> None:
    """Until the courier sleeps out its poll: only a new signal starts its next pass."""
    async with asyncio.timeout(WAIT):
        while clock.sleepers != 1 or courier._wake.is_set() or any(courier.in_flight.values()):
            await asyncio.sleep(0.005)


def test_an_attempt_an_event_or_a_retry_wakes_it_before_its_poll(store: Store) -> None:
    codes = [200, 404, 200, 200]
    target = Target(lambda request, body, n: codes.pop(0))
    sid = bound(store)

    async def main() -> None:
        clock = FakeClock()  # never moved: no pass after the first but by a signal
        courier, watch, _ = make(store, target, clock=clock, poll_interval=60)
        async with running(courier):
            await asleep(courier, clock)
            seq = answer(store, sid, "first")
            courier.nudge(sid, {"type": "model_response", "seq": seq})  # what the pool says
            await watch.until(lambda: len(watch.outcomes) == 1)
            await asleep(courier, clock)
            for text in ("second", "third"):
                seq = answer(store, sid, text)
            courier.nudge(sid, {"type": "model_response", "seq": seq})
            # The third goes once the second is finished (dead): its attempt's signal.
            await watch.until(lambda: len(watch.outcomes) == 3)
            assert [d.status for d in rows(store, sid)] == ["delivered", "dead", "delivered"]
            await asleep(courier, clock)
            assert store.deliveries.retry(rows(store, sid)[1].id) is not None
            courier.stir()  # what the API does after an operator's retry
            await watch.until(lambda: len(watch.outcomes) == 4)
        assert clock.monotonic() == 1_000.0

    asyncio.run(main())
    assert [d.status for d in rows(store, sid)] == ["delivered"] * 3


def test_it_rests_until_the_soonest_retry_not_its_poll(store: Store) -> None:
    """A retry due in 10 s is the courier's next pass, whatever `delivery.poll_interval`
    (after a restart too: the time is the row's, and a boot passes at once)."""
    target = Target(lambda request, body, n: 503)
    sid = bound(store, answers=1)

    async def main() -> None:
        clock = FakeClock(wall=time.time())  # the age of a delivery is on its wall clock
        courier, watch, _ = make(
            store, target, clock=clock, poll_interval=60, backoff=20, backoff_cap=20
        )  # no jitter: the first retry is due 10 s after the first attempt
        async with running(courier):
            await watch.until(lambda: len(watch.outcomes) == 1)
            await asleep(courier, clock)
            [row] = rows(store, sid)
            waits = (clock.wakes_at or 0.0) - clock.monotonic() - SLACK
            assert row.status == "pending"
            assert row.next_at - store.deliveries.now() <= waits <= 10.0

    asyncio.run(main())
