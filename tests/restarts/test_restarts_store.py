"""The restart requests on SQLite, PostgreSQL and MariaDB: a request written whole (row and
`restart_requested`) or not at all and fenced by the turn's lease; a live request answers
for the host, the rate limit on the database clock, a repeated tool call, one new row of
four concurrent requests; begin only from pending; a settlement once, by how the boot that
admitted it ended, telling its session (unless closed) and waking it."""

from __future__ import annotations

import json
import re
import threading
import uuid
from typing import Any

import pytest

from supervisor.core.vocabulary import RestartState
from supervisor.restarts import rules
from supervisor.store import (
    Admitted,
    LeaseLost,
    RateLimited,
    RestartInfo,
    Store,
)
from supervisor.store.models import RestartRequest
from tests.conftest import BACKENDS
from tests.support import stored_events as events

pytestmark = pytest.mark.parametrize("db_url", BACKENDS, indirect=True)

V0, V1 = "0.9.0", "0.9.1"
C0, C1 = "aaaaaaaaaaaa", "bbbbbbbbbbbb"


class Turn:
    """A session's turn in flight on a lease, as a worker holds it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.session_id = store.sessions.create("alice").id
        lease = store.leases.acquire(self.session_id, f"host-a/boot-1/w{uuid.uuid4().hex[:6]}", 30)
        assert lease is not None
        self.token, self.id = lease.token, uuid.uuid4().hex
        store.events.append(
            self.session_id, "turn_started", {}, token=self.token, turn_id=self.id, writer="worker"
        )

    def ask(self, boot: str, call_id: str | None = "call-1", **options: Any) -> Admitted:
        options.setdefault("token", self.token)
        return ask(
            self.store, boot, session=self.session_id, turn_id=self.id, call_id=call_id, **options
        )


def ask(store: Store, boot: str, **options: Any) -> Admitted:
    """A request of host-a's daemon (boot `boot`)."""
    values: dict[str, Any] = {
        "host": "host-a",
        "pid": 4242,
        "by": "agent" if options.get("session") else "ops",
        "reason": "load the new tools",
        "drain": None,
        "version": V0,
        "config": C0,
        "min_interval": 60.0,
    }
    return store.restarts.request(boot=boot, **(values | options))


def boot(store: Store, host: str = "host-a") -> str:
    return store.boots.begin(host, 4242, V0)


def settled_clean(store: Store, restart: RestartInfo) -> None:
    """The admitting boot stops cleanly and the next boot settles the request."""
    store.boots.end(restart.boot, "clean")
    assert store.restarts.settle(restart.id, boot=boot(store), version=V0, config=C0)


def test_a_request_writes_its_row_and_event_together(store: Store) -> None:
    turn, booted = Turn(store), boot(store)
    asked = turn.ask(booted, reason="new\ttools\x00 please", drain=12.5)
    info = asked.info
    assert asked.new and info.state == RestartState.PENDING and info.active_host == "host-a"
    assert (info.host, info.boot, info.pid, info.session, info.turn_id, info.call_id) == (
        "host-a", booted, 4242, turn.session_id, turn.id, "call-1",
    )  # fmt: skip
    assert (info.requested_by, info.reason, info.drain) == ("agent", "new tools please", 12.5)
    assert (info.version_before, info.config_before, info.outcome, info.detail) == (
        V0,
        C0,
        None,
        "",
    )
    assert abs(info.requested_at - store.now()) < 5  # the database clock
    [event] = events(store, turn.session_id, "restart_requested")
    assert (event.seq, event.turn_id, event.writer) == (asked.seq, turn.id, "worker")
    assert event.seq == info.request_seq
    assert event.payload == {"restart": info.id, "reason": "new tools please", "by": "agent"}
    assert store.restarts.get(info.id) == info and store.restarts.active("host-a") == info
    assert json.loads(json.dumps(info.as_dict()))["id"] == info.id
    assert store.restarts.counts() == {"pending": 1, "restarting": 0, "done": 0}
    # An operator's request: a row, no event.
    other = ask(store, boot(store, "host-b"), host="host-b", by="ops")
    assert other.new and other.seq is None and other.info.session is None
    assert other.info.request_seq is None and other.info.requested_by == "ops"
    assert [r.id for r in store.restarts.list()] == [other.info.id, info.id]
    assert [r.id for r in store.restarts.list(host="host-a", limit=1)] == [info.id]
    with pytest.raises(ValueError, match="reason must be a string"):
        ask(store, booted, host="host-c", reason=["no"])


def test_a_request_with_a_lost_lease_writes_nothing(store: Store) -> None:
    turn = Turn(store)
    store.leases.acquire(turn.session_id, "host-b/boot-2/w1", 30, force=True)
    with pytest.raises(LeaseLost):
        turn.ask(boot(store))
    with pytest.raises(LeaseLost):
        turn.ask(boot(store), token=None)
    assert store.restarts.list() == [] and store.restarts.active("host-a") is None
    assert events(store, turn.session_id, "restart_requested") == []


def test_a_live_request_answers_for_its_host(store: Store) -> None:
    booted = boot(store)
    first = ask(store, booted).info
    turn = Turn(store)
    again = turn.ask(booted, min_interval=0.0)  # in progress comes before any rate limit
    assert (again.new, again.seq, again.info) == (False, None, first)
    assert events(store, turn.session_id, "restart_requested") == []
    begun = store.restarts.begin(first.id, boot=booted, version=V1, config=C1)
    assert begun is not None and ask(store, booted).info == begun  # restarting is live too
    assert len(store.restarts.list()) == 1
    # Another host's request is its own.
    assert ask(store, booted, host="host-b").new


def test_the_rate_limit_is_timed_by_the_database_clock(store: Store) -> None:
    booted = boot(store)
    first = ask(store, booted).info
    settled_clean(store, first)
    with pytest.raises(RateLimited) as limited:
        ask(store, booted)
    assert limited.value.last.id == first.id
    waited = store.now() - first.requested_at
    assert limited.value.retry_after == pytest.approx(60.0 - waited, abs=2.0)
    assert str(limited.value).startswith("a restart was requested ")
    assert f"({first.id}); restart.min_interval is 60 s: try again in " in str(limited.value)
    # Asked 50 s ago: 10 s to wait.
    RestartRequest.update(requested_at=RestartRequest.requested_at - 50).execute()
    with pytest.raises(RateLimited) as limited:
        ask(store, booted)
    assert limited.value.retry_after == pytest.approx(10.0 - waited, abs=2.0)
    assert len(store.restarts.list()) == 1
    # A turn's request is limited too, and writes nothing.
    turn = Turn(store)
    with pytest.raises(RateLimited):
        turn.ask(booted)
    assert events(store, turn.session_id, "restart_requested") == []
    # Once min_interval has passed, a new one.
    RestartRequest.update(requested_at=RestartRequest.requested_at - 11).execute()
    assert ask(store, booted).new


def test_a_repeated_tool_call_gets_its_first_row(store: Store) -> None:
    turn, booted = Turn(store), boot(store)
    first = turn.ask(booted, call_id="call-7")
    again = turn.ask(booted, call_id="call-7")
    assert (again.new, again.info, again.seq) == (False, first.info, first.seq)
    # Whatever its state, and whatever the rate limit says now.
    settled_clean(store, first.info)
    after = turn.ask(booted, call_id="call-7")
    assert (after.new, after.info.id, after.seq) == (False, first.info.id, first.seq)
    assert after.info.state == RestartState.DONE
    with pytest.raises(RateLimited):
        turn.ask(booted, call_id="call-8")
    assert len(events(store, turn.session_id, "restart_requested")) == 1
    # A hostile call id is kept hashed, and still finds its row.
    odd = "x\x00" + "y" * 500
    RestartRequest.update(requested_at=RestartRequest.requested_at - 61).execute()
    made = turn.ask(booted, call_id=odd)
    assert made.new and made.info.call_id is not None and made.info.call_id.startswith("sha256:")
    assert turn.ask(booted, call_id=odd).info == made.info


def test_four_concurrent_requests_make_one_row(store: Store) -> None:
    booted = boot(store)
    turns = [Turn(store) for _ in range(2)]
    start = threading.Barrier(4)
    answers: list[Admitted] = []
    failed: list[BaseException] = []

    def request(index: int) -> None:  # each thread has its own connection
        start.wait()
        try:
            if index < 2:
                answers.append(turns[index].ask(booted, min_interval=0.0))
            else:
                answers.append(ask(store, booted, by=f"ops{index}", min_interval=0.0))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failed == [] and len(answers) == 4
    [new] = [a for a in answers if a.new]
    assert all(a.info == new.info and a.seq is None for a in answers if not a.new)
    assert [r.id for r in store.restarts.list()] == [new.info.id]
    asked = sum(len(events(store, t.session_id, "restart_requested")) for t in turns)
    assert asked == (1 if new.info.session else 0)


def test_an_insert_that_lost_the_race_is_answered_in_progress(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    booted = boot(store)
    first = ask(store, booted).info
    turn = Turn(store)
    seen: list[bool] = []

    def blind(active: bool, last: float | None, now: float, min_interval: float) -> Any:
        """The first read misses the live row, as one racing its commit does."""
        seen.append(active)
        return rules.Admission("new") if len(seen) == 1 else real(active, last, now, min_interval)

    real = rules.admit
    monkeypatch.setattr(rules, "admit", blind)
    again = turn.ask(booted)
    assert seen == [True, True]  # read again after the unique index failed the insert
    assert (again.new, again.seq, again.info) == (False, None, first)
    assert events(store, turn.session_id, "restart_requested") == []  # rolled back with it
    assert [r.id for r in store.restarts.list()] == [first.id]


def test_begin_moves_only_a_pending_request(store: Store) -> None:
    booted = boot(store)
    info = ask(store, booted).info
    later = boot(store)
    begun = store.restarts.begin(info.id, boot=later, version=V1, config=C1)
    assert begun is not None and begun.state == RestartState.RESTARTING
    assert (begun.boot, begun.version_before, begun.config_before) == (later, V1, C1)
    assert begun.started_at is not None and begun.started_at >= info.requested_at
    assert store.restarts.begin(info.id, boot=later, version=V0, config=C0) is None
    assert store.restarts.get(info.id) == begun
    assert store.restarts.unsettled("host-a") == [begun] and store.restarts.unsettled("b") == []
    assert store.restarts.begin("nothing-such", boot=later, version=V0, config=C0) is None
    store.restarts.settle(info.id, boot=later, version=V1, config=C1)
    assert store.restarts.begin(info.id, boot=later, version=V0, config=C0) is None


def test_a_settlement_tells_its_session_once(store: Store) -> None:
    turn, booted = Turn(store), boot(store)
    asked = turn.ask(booted).info
    assert store.restarts.begin(asked.id, boot=booted, version=V0, config=C0)
    store.events.append(
        turn.session_id, "turn_ended", {"outcome": "completed"}, token=turn.token, turn_id=turn.id
    )
    assert not store.sessions.get(turn.session_id).pending
    store.boots.end(booted, "clean")
    after = boot(store)
    settled = store.restarts.settle(asked.id, boot=after, version=V1, config=C1)
    assert settled is not None
    info = settled.info
    assert (info.state, info.outcome, info.detail, info.active_host) == ("done", "ok", "", None)
    assert (info.boot_after, info.version_after, info.config_after) == (after, V1, C1)
    assert info.settled_at is not None and info.started_at is not None
    assert info.seconds == pytest.approx(info.settled_at - info.started_at)
    notice, result = events(store, turn.session_id)[-2:]
    assert (notice.type, notice.seq, notice.writer, notice.turn_id) == (
        "notice", settled.notice_seq, "supervisor", None,
    )  # fmt: skip
    assert notice.payload["text"].startswith("The restart this session asked for completed in")
    assert (notice.payload["restart"], notice.payload["outcome"]) == (asked.id, "ok")
    assert (result.type, result.seq, result.writer, result.turn_id) == (
        "restart_result", settled.result_seq, "supervisor", None,
    )  # fmt: skip
    assert result.payload == {
        "restart": asked.id, "outcome": "ok", "detail": "", "seconds": info.seconds,
        "reason": "load the new tools", "version_before": V0, "version_after": V1,
        "config_before": C0, "config_after": C1,
    }  # fmt: skip
    assert (info.notice_seq, info.result_seq) == (notice.seq, result.seq)
    assert store.sessions.get(turn.session_id).pending  # its next turn reads the result
    # Exactly once: a second settlement, by this boot or another, writes nothing.
    count = len(events(store, turn.session_id))
    assert store.restarts.settle(asked.id, boot=after, version=V1, config=C1) is None
    assert store.restarts.settle(asked.id, boot=boot(store), version=V1, config=C1) is None
    assert store.restarts.settle("nothing-such", boot=after, version=V1, config=C1) is None
    assert len(events(store, turn.session_id)) == count
    assert store.restarts.get(asked.id) == info and store.restarts.unsettled("host-a") == []
    assert store.restarts.counts() == {"pending": 0, "restarting": 0, "done": 1}
    # The host may ask again (past the rate limit): the live slot is free.
    assert turn.ask(booted, call_id="call-2", min_interval=0.0).new


def test_two_daemons_settling_at_once_settle_once(store: Store) -> None:
    turn, booted = Turn(store), boot(store)
    asked = turn.ask(booted).info
    start = threading.Barrier(4)
    won: list[Any] = []
    done: list[int] = []

    def settle(index: int) -> None:
        start.wait()
        if store.restarts.settle(asked.id, boot=f"b{index}", version=V1, config=C1) is not None:
            won.append(index)
        done.append(index)

    threads = [threading.Thread(target=settle, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(done) == 4 and len(won) == 1
    assert len(events(store, turn.session_id, "restart_result")) == 1
    assert len(events(store, turn.session_id, "notice")) == 1


def test_a_closed_session_is_told_nothing_but_the_request_is_settled(store: Store) -> None:
    turn, booted = Turn(store), boot(store)
    asked = turn.ask(booted).info
    store.sessions.close(turn.session_id, "alice")
    count = len(events(store, turn.session_id))
    store.boots.end(booted, "clean")
    settled = store.restarts.settle(asked.id, boot=boot(store), version=V0, config=C0)
    assert settled is not None and (settled.notice_seq, settled.result_seq) == (None, None)
    assert (settled.info.state, settled.info.outcome) == ("done", "ok")
    assert settled.info.detail.startswith("the daemon was stopped and started again before")
    assert len(events(store, turn.session_id)) == count
    assert not store.sessions.get(turn.session_id).pending


@pytest.mark.parametrize(
    ("ended", "begun", "refused", "outcome", "detail"),
    [
        ("clean", True, None, "ok", "^$"),
        ("clean", False, None, "ok", "before it began the restart itself"),
        ("unclean", True, None, "failed", r"did not stop cleanly \(something was left behind"),
        ("startup_failed", True, None, "failed", "never become ready"),
        (None, True, None, "failed", r"\(it crashed or was killed\)"),
        (None, False, None, "failed", r"\(it crashed or was killed\)"),
        ("clean", False, "the configuration does not load", "failed",
         "^the restart did not happen: the configuration does not load$"),
    ],
)  # fmt: skip
def test_the_outcome_is_how_the_admitting_boot_ended(
    store: Store, ended: str | None, begun: bool, refused: str | None, outcome: str, detail: str
) -> None:
    turn, booted = Turn(store), boot(store)
    asked = turn.ask(booted).info
    if begun:
        assert store.restarts.begin(asked.id, boot=booted, version=V0, config=C0)
    if ended is not None:
        store.boots.end(booted, ended)
    settled = store.restarts.settle(
        asked.id, boot=boot(store), version=V0, config=C0, refused=refused
    )
    assert settled is not None and settled.info.outcome == outcome
    assert re.search(detail, settled.info.detail), settled.info.detail
    [result] = events(store, turn.session_id, "restart_result")
    assert (result.payload["outcome"], result.payload["detail"]) == (outcome, settled.info.detail)
    [notice] = events(store, turn.session_id, "notice")
    verb = "completed" if outcome == "ok" else "did not complete cleanly"
    assert notice.payload["text"].startswith(f"The restart this session asked for {verb}")
    start = settled.info.started_at if begun else settled.info.requested_at
    assert start is not None and settled.info.settled_at is not None
    assert settled.info.seconds == pytest.approx(settled.info.settled_at - start)
