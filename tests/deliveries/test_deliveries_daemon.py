"""Outbound deliveries with the daemon as a real process (issue 18) and real receivers on
loopback (`tests.deliveries_receiver`): every final answer reaches its target once after
the receiver's dedupe, signed, in seq order per session, whatever 5xx answers, a receiver
that is down and SIGKILLs of the whole daemon do; a receiver down for a long while
(refusing, then answering 503, for 2 minutes) gets every delivery
once it is back; a target that keeps failing ends `dead` after `max_attempts` (a 4xx at
once) and an operator's retry sends it again (a target's every dead delivery in the order
they were produced); an answer committed by a turn that was interrupted before its
`turn_ended` is delivered once without the model being called again; a target that is
down or hung holds back no other target's deliveries."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.conftest import this_host_id
from tests.daemon import daemons, events, inject, turn_ended, turnkeeper, wait_until
from tests.deliveries_harness import (
    CLAIMED,
    Daemons,
    Receivers,
    answers,
    bound,
    delivering,
    explained,
    kill_and_restart,
    metric,
    receivers,
    rows,
    settled,
)

__all__ = ["daemons", "receivers"]  # the fixtures

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_every_answer_is_delivered_once_in_order_through_failures_and_three_sigkills(
    daemons: Daemons, receivers: Receivers, tmp_path: Path, db_url: str
) -> None:
    hook = receivers("hook")
    hook.answer = 500
    server = {} if db_url.startswith("sqlite") else {"store": {"url": db_url}}
    daemon = delivering(
        daemons,
        {"hook": hook},
        timeout=CLAIMED,
        delivery={"max_attempts": 100},
        recovery={"max_per_pass": 50},  # every interrupted turn is continued at the boot
        **server,
    )
    if server:
        daemon.url = db_url
    daemon.start()
    with Store(daemon.url, migrate=False) as store, explained(daemon, store, hook=hook):
        sessions = [bound(daemon, "hook") for _ in range(20)]
        # 1. The first answers are committed while the target answers 500.
        firsts = [inject(store, sid, f"first {n}") for n, sid in enumerate(sessions)]
        for sid, seq in zip(sessions, firsts, strict=True):
            wait_until(lambda sid=sid, seq=seq: turn_ended(store, sid, seq), 30, "a first turn")
        wait_until(lambda: len(hook.keys()) == 20, 30, "an attempt at each first answer")
        wait_until(lambda: len(hook.records) >= 40, 30, "attempts after the backoff")
        kill_and_restart(daemon)  # kill 1: with deliveries in their backoff

        # 2. The second turns are held in flight; the receiver goes down.
        gate = tmp_path / "gate"
        seconds = [inject(store, s, f"/gate {gate} second {n}") for n, s in enumerate(sessions)]
        for sid, seq in zip(sessions, seconds, strict=True):
            wait_until(
                lambda sid=sid, seq=seq: (
                    store.sessions.get(sid).active_turn_id
                    and any(e.type == "turn_started" for e in store.events.read(sid, after=seq))
                ),
                30,
                "a second turn to start",
            )
        hook.stop()
        wait_until(
            lambda: any(
                d.last_code is None and d.attempts for s in sessions for d in rows(store, s)
            ),
            30,
            "an attempt refused by the stopped receiver",
        )
        daemon.kill_everything()  # kill 2: with turns in flight and the receiver down
        gate.touch()
        daemon.start()
        for sid, seq in zip(sessions, seconds, strict=True):
            ended = wait_until(
                lambda sid=sid, seq=seq: turn_ended(store, sid, seq), 40, "a continued turn"
            )
            assert ended.payload["outcome"] == "completed", ended.payload

        # 3. The receiver is back and holds what it is sent: killed while attempts wait
        # for their answer, which the next boot must send again under the same key.
        hook.hold()
        hook.answer = 200
        before = len(hook.records)
        hook.start()
        wait_until(lambda: hook.waiting >= 1, 30, "an attempt held at the receiver")
        daemon.kill_everything()  # kill 3: with attempts in flight
        held = {r.key for r in hook.records[before:]}  # all of them unanswered
        hook.release()  # answered to a dead courier: sent again, same key
        daemon.start()
        # Within a claim's life: the dead boot's claims were free at once, not run out.
        wait_until(lambda: settled(store, sessions), CLAIMED, "every delivery to be delivered")

        # What the receiver got: each answer once after its dedupe, signed, in order.
        records = hook.records
        unverified = [(r.key, r.at, len(r.raw), r.headers) for r in records if not r.verified]
        assert records and not unverified, unverified
        first = hook.first_seen()
        for key, repeats in hook.duplicates.items():
            copies = [r.raw for r in records if r.key == key]
            assert len(copies) == repeats + 1 and len(set(copies)) == 1, key
        assert len({(r.session, r.seq) for r in first}) == len(first), "one answer, two keys"
        order: dict[str, list[int]] = defaultdict(list)
        for received in first:
            order[received.session].append(received.seq)
        for sid in sessions:
            assert order[sid] == sorted(order[sid]) == sorted(set(order[sid])), (sid, order[sid])
            said = answers(store, sid)
            # No turn was run again to make a delivery: one answer per turn and per message.
            assert len({e.turn_id for e in said}) == len(said), sid
            messages = [e for e in events(store, sid) if e.type == "user_message"]
            assert len(said) == len(messages) == 2, sid
            assert order[sid] == [e.seq for e in said], sid
            delivered = rows(store, sid)
            assert [(d.seq, d.kind, d.status) for d in delivered] == [
                (e.seq, "answer", "delivered") for e in said
            ]
            by_key = {r.key: r for r in first}
            for d, e in zip(delivered, said, strict=True):
                assert by_key[d.id].document["text"] == e.payload["text"]
                assert by_key[d.id].document["type"] == "answer"
            # Nothing of the session was sent before the receiver took the one before it.
            for earlier, later in itertools.pairwise(delivered):
                taken = hook.accepted_at(earlier.id)
                assert taken is not None, earlier
                assert all(r.at > taken for r in records if r.key == later.id), (sid, later)
        assert hook.keys() == {d.id for s in sessions for d in rows(store, s)}
        assert held <= hook.keys()
        # Accepted twice only what was in flight at the kill: its 2xx never reached the courier.
        twice = {key for key, n in hook.accepted.items() if n > 1}
        assert twice <= held, twice - held
        assert set(hook.accepted) == hook.keys()
        assert store.deliveries.counts()["pending"] == 0
    print(
        {
            "requests": len(records),
            "answers": len(first),
            "duplicates": sum(hook.duplicates.values()),
            "accepted_twice": len(twice),
            "torn": hook.torn,
            "boots": daemon.runs,
        }
    )


def outage(store: Store, seconds: float) -> None:
    """Let `seconds` pass with the receiver down, failing at once if a delivery is given up
    meanwhile."""
    end = time.monotonic() + seconds

    def over() -> bool:
        assert store.deliveries.counts()["dead"] == 0, "a delivery was given up in the outage"
        return time.monotonic() >= end

    wait_until(over, seconds + 30, f"{seconds} s of outage", interval=0.5)


@pytest.mark.slow
def test_a_receiver_down_for_two_minutes_gets_every_delivery_once_it_is_back(
    daemons: Daemons, receivers: Receivers
) -> None:
    down = 120.0
    hook = receivers("hook")
    # The defaults but for the backoff: no attempt limit, a day to deliver. Of old, five
    # attempts 1 s doubling gave up within 15 s; a cap of 5 s keeps the wait after the
    # receiver is back short.
    daemon = delivering(daemons, {"hook": hook}, delivery={"backoff": 1, "backoff_cap": 5})
    daemon.start()
    with Store(daemon.url, migrate=False) as store, explained(daemon, store, hook=hook):
        sessions = [bound(daemon, "hook") for _ in range(3)]
        hook.stop()  # connections refused
        for half, text in enumerate(["before", "during"]):
            for sid in sessions:
                seq = inject(store, sid, f"{text} the outage")
                wait_until(lambda sid=sid, seq=seq: turn_ended(store, sid, seq), 30, "a turn")
            outage(store, down / 2)
            if half == 0:
                hook.answer = 503  # up again, and failing
                hook.start()
        produced = [d for s in sessions for d in rows(store, s)]
        assert len(produced) == 6 and {d.status for d in produced} == {"pending"}
        firsts = [rows(store, s)[0] for s in sessions]
        assert all(d.attempts >= 6 for d in firsts), [d.attempts for d in firsts]
        assert hook.records and not hook.accepted  # attempts answered 503

        hook.answer = 200
        wait_until(lambda: settled(store, sessions), 30, "every delivery, once it is back")
        assert store.deliveries.counts() == {"pending": 0, "delivered": 6, "dead": 0}
        assert hook.accepted == {d.id: 1 for d in produced}  # each taken once
        for sid in sessions:
            first, second = rows(store, sid)
            taken = hook.accepted_at(first.id)
            assert taken is not None
            assert all(r.at > taken for r in hook.records if r.key == second.id), sid


def test_a_target_that_keeps_failing_is_dead_after_max_attempts_until_retried(
    daemons: Daemons, receivers: Receivers
) -> None:
    hook = receivers("hook")
    hook.answer = 500
    daemon = delivering(daemons, {"hook": hook}, delivery={"max_attempts": 3}).start()
    with Store(daemon.url, migrate=False) as store, explained(daemon, store, hook=hook):
        sid = bound(daemon, "hook")
        inject(store, sid, "hello")
        wait_until(lambda: settled(store, [sid], "dead"), 30, "the delivery to be dead")
        [dead] = rows(store, sid)
        assert (dead.attempts, dead.last_code, dead.kind) == (3, 500, "answer")
        assert "HTTP 500" in dead.last_error
        assert [r.key for r in hook.records] == [dead.id] * 3
        assert all(r.verified for r in hook.records)
        with daemon.client() as client:
            listed = client.get("/v1/deliveries", params={"status": "dead"})
            scraped = client.get("/metrics").text
        assert listed.status_code == 200, listed.text
        [shown] = listed.json()["deliveries"]
        assert (shown["id"], shown["status"], shown["attempts"]) == (dead.id, "dead", 3)
        assert (shown["last_code"], shown["session"], shown["kind"]) == (500, sid, "answer")
        table = turnkeeper(daemon, "deliveries", "list", "--status", "dead")
        assert table.returncode == 0, table.stderr
        [row] = [line.split() for line in table.stdout.splitlines() if dead.id in line]
        assert row[:7] == [dead.id, "hook", sid, str(dead.seq), "answer", "dead", "3"], row
        assert metric(scraped, "turnkeeper_deliveries", status="dead") == 1.0
        assert metric(scraped, "turnkeeper_deliveries", status="pending") == 0.0
        assert metric(scraped, "turnkeeper_delivery_attempts_total", outcome="dead") == 1.0
        assert metric(scraped, "turnkeeper_delivery_attempts_total", outcome="failed") == 2.0
        assert "dead after 3 attempt(s)" in daemon.log()

        # The target is fixed; the operator's retry sends it again, attempts from 0.
        hook.answer = 200
        with daemon.client() as client:
            retried = client.post(f"/v1/deliveries/{dead.id}/retry")
        assert retried.status_code == 200, retried.text
        assert (retried.json()["status"], retried.json()["attempts"]) == ("pending", 0)
        wait_until(lambda: settled(store, [sid]), 30, "the retried delivery")
        [done] = rows(store, sid)
        assert (done.id, done.attempts, done.last_code) == (dead.id, 1, 200)
        assert [r.key for r in hook.records] == [dead.id] * 4
        assert hook.first_seen()[0].raw == hook.records[-1].raw  # the same delivery
        with daemon.client() as client:
            scraped = client.get("/metrics").text
        assert metric(scraped, "turnkeeper_deliveries", status="dead") == 0.0
        assert metric(scraped, "turnkeeper_deliveries", status="delivered") == 1.0
        assert metric(scraped, "turnkeeper_delivery_attempts_total", outcome="delivered") == 1.0


def test_a_4xx_answer_is_dead_after_one_attempt(daemons: Daemons, receivers: Receivers) -> None:
    hook = receivers("hook")
    hook.answer = 400
    daemon = delivering(daemons, {"hook": hook}, delivery={"max_attempts": 5}).start()
    with Store(daemon.url, migrate=False) as store, explained(daemon, store, hook=hook):
        refused = bound(daemon, "hook")
        inject(store, refused, "refused")
        wait_until(lambda: settled(store, [refused], "dead"), 30, "the refused delivery")
        [dead] = rows(store, refused)
        assert (dead.attempts, dead.last_code) == (1, 400)
        # Another session's answer gets through once the target takes them: by then the
        # dead one would have been sent again, were it to be.
        hook.answer = 200
        later = bound(daemon, "hook")
        inject(store, later, "accepted")
        wait_until(lambda: settled(store, [later]), 30, "the later delivery")
        assert [r.session for r in hook.records] == [refused, later]
        assert rows(store, refused)[0].status == "dead"
        # The operator's retry from the command line sends it again; once delivered it is
        # not sent twice.
        again = turnkeeper(daemon, "deliveries", "retry", dead.id)
        assert again.returncode == 0, again.stderr
        assert f"delivery {dead.id} to hook: pending, attempts 0" in again.stdout
        wait_until(lambda: settled(store, [refused]), 30, "the retried delivery")
        assert [r.session for r in hook.records] == [refused, later, refused]
        assert (rows(store, refused)[0].attempts, rows(store, refused)[0].last_code) == (1, 200)
        twice = turnkeeper(daemon, "deliveries", "retry", dead.id)
        assert twice.returncode == 1 and "already delivered" in twice.stderr, twice


def test_retry_all_sends_a_target_s_dead_deliveries_in_the_order_they_were_produced(
    daemons: Daemons, receivers: Receivers
) -> None:
    hook = receivers("hook")
    hook.answer = 400  # each delivery dead at once
    # One attempt at a time: the order the receiver sees is the order they were sent.
    daemon = delivering(daemons, {"hook": hook}, delivery={"concurrency": 1}).start()
    with Store(daemon.url, migrate=False) as store, explained(daemon, store, hook=hook):
        sessions = [bound(daemon, "hook") for _ in range(3)]
        for n in range(2):  # produced in turn: one session's answers among the others'
            for sid in sessions:
                seq = inject(store, sid, f"message {n}")
                wait_until(lambda sid=sid, seq=seq: turn_ended(store, sid, seq), 30, "a turn")
        wait_until(
            lambda: (
                all(len(rows(store, s)) == 2 for s in sessions) and settled(store, sessions, "dead")
            ),
            30,
            "every delivery to be dead",
        )
        produced = sorted(
            (d for s in sessions for d in rows(store, s)), key=lambda d: (d.created_at, d.seq)
        )
        refused = len(hook.records)
        hook.answer = 200
        retried = turnkeeper(daemon, "deliveries", "retry", "--all", "--target", "hook")
        assert retried.returncode == 0, retried.stderr
        assert "6 dead and 0 pending deliveries sent again now" in retried.stdout
        wait_until(lambda: settled(store, sessions), 30, "the revived deliveries")
        assert [r.key for r in hook.records[refused:]] == [d.id for d in produced]


def test_an_answer_committed_before_a_crash_is_delivered_once_without_a_model_call(
    daemons: Daemons, receivers: Receivers
) -> None:
    hook = receivers("hook")
    daemon = delivering(daemons, {"hook": hook}).start()
    with Store(daemon.url, migrate=False) as store, explained(daemon, store, hook=hook):
        boot = store.boots.recent(1)[0]
        sid = bound(daemon, "hook")
        daemon.kill_everything()
        # What the dead boot's worker had committed: the turn's final answer, and no
        # `turn_ended` (the crash came between the two).
        lease = store.leases.acquire(sid, f"{this_host_id()}/{boot.boot_id[:8]}/w0.1", 30)
        assert lease is not None
        read = inject(store, sid, "question")
        store.events.append(
            sid, "turn_started", {"read_to": read}, turn_id="t1", token=lease.token, writer="worker"
        )
        answer = {"text": "committed before the crash", "tool_calls": [], "finish_reason": "stop"}
        store.events.append(
            sid, "model_response", answer, turn_id="t1", token=lease.token, writer="worker"
        )
        [pending] = rows(store, sid)
        assert (pending.status, pending.attempts) == ("pending", 0)

        daemon.start()
        ended = wait_until(lambda: turn_ended(store, sid), 30, "recovery to end the turn")
        assert ended.turn_id == "t1"
        assert ended.payload == {"outcome": "completed", "recovered": True}
        wait_until(lambda: settled(store, [sid]), 30, "the answer's delivery")
        # The next message's answer is delivered after it: no second copy came meanwhile.
        second = inject(store, sid, "next")
        wait_until(lambda: turn_ended(store, sid, second), 30, "the next turn")
        wait_until(lambda: len(rows(store, sid)) == 2 and settled(store, [sid]), 30, "its delivery")
        turn = [e for e in events(store, sid) if e.turn_id == "t1"]
        assert [e.type for e in turn] == ["turn_started", "model_response", "turn_ended"]
        assert [(r.key, r.document["text"]) for r in hook.records] == [
            (pending.id, "committed before the crash"),
            (rows(store, sid)[1].id, "echo: next"),
        ]


def test_a_target_that_is_down_or_hung_holds_back_no_other_targets_deliveries(
    daemons: Daemons, receivers: Receivers
) -> None:
    hung, down, live = receivers("hung"), receivers("down"), receivers("live")
    hung.hold()  # takes each request and never answers (within the test)
    down.stop()  # refuses every connection
    daemon = delivering(
        daemons,
        {"hung": hung, "down": down, "live": live},
        timeout=120.0,  # longer than any wait below: a courier that waited would fail it
        delivery={"concurrency": 2, "max_attempts": 100},
    ).start()
    with (
        Store(daemon.url, migrate=False) as store,
        explained(daemon, store, hung=hung, down=down, live=live),
    ):
        stuck = [bound(daemon, "hung") for _ in range(3)]
        for sid in stuck:
            inject(store, sid, "into the void")
        wait_until(lambda: hung.waiting == 2, 30, "the hung target's room to fill")
        refused = [bound(daemon, "down") for _ in range(2)]
        for sid in refused:
            inject(store, sid, "nobody home")
        wait_until(
            lambda: all(d.attempts >= 2 for s in refused for d in rows(store, s)),
            30,
            "attempts refused by the target that is down",
        )
        served = [store.sessions.create("admin").id for _ in range(6)]
        with daemon.client() as client:  # bound after they were made
            for sid in served:
                put = client.put(f"/v1/sessions/{sid}", json={"deliver_to": "live"})
                assert put.status_code == 200 and put.json()["deliver_to"] == "live", put.text
        for sid in served:
            inject(store, sid, "hello")
        wait_until(lambda: settled(store, served), 30, "the live target's deliveries")
        assert sorted(r.session for r in live.first_seen()) == sorted(served)
        assert hung.waiting == 2  # still in flight, unanswered
        hung_rows = [d for s in stuck for d in rows(store, s)]
        assert [(d.status, d.attempts) for d in hung_rows] == [("pending", 0)] * 3
        assert len(hung.records) == 2  # concurrency 2: the third waits its turn
        for d in (d for s in refused for d in rows(store, s)):
            assert d.status == "pending" and d.last_code is None and d.last_error, d
