"""Guards of the deliveries: an operator's retry leaves a delivery being sent right now to
its attempt; the metrics count only the verdicts written under their claim; a cut answer
and a turn's outcome are carried; a target that names its principals is bound to by them
(and the admin) only; and a worker drops every target's secret before an agent runs.

`EnvAgent` is this module's agent plug-in: the worker (a real process) imports it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor.core.vocabulary import AttemptOutcome, DeliveryStatus
from supervisor.deliveries.rules import kind_of, text_of
from supervisor.store import Store
from tests.conftest import BACKENDS
from tests.daemon import Daemon, daemons, wait_until
from tests.deliveries.test_deliveries_api import bind, delivery_config, start
from tests.deliveries.test_deliveries_courier import (
    OWNER,
    SECRETS,
    Target,
    answer,
    attempts,
    bound,
    make,
    rows,
    running,
)
from tests.deliveries_receiver import Receiver
from tests.http.test_api import Api, assert_error, create_session, free_port, inject
from workers.agent import Turn

__all__ = ["daemons", "start"]  # the fixtures

SEEN = "TK_TEST_GUARD_SECRET"  # a target's secret_env: the supervisor's, never an agent's
VISIBLE = "TK_TEST_GUARD_VISIBLE"  # any other variable: the agent sees it


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, env in SECRETS.items():
        monkeypatch.setenv(env, f"secret of {name.lower()}")


# --- a retry of a delivery being sent (every backend) ---------------------------------


def claimed_again(store: Store, target: str, lease: float) -> str:
    """The one delivery to `target`, attempted once (pending, due now: next_at set), then
    claimed by OWNER for `lease` seconds (negative: a claim that ran out)."""
    [outgoing] = store.deliveries.claim(OWNER, {target: 60.0}, 10)
    delivery_id = outgoing.delivery.id
    assert store.deliveries.finish(delivery_id, OWNER, DeliveryStatus.PENDING, error="HTTP 503")
    [again] = store.deliveries.claim(OWNER, {target: lease}, 10)
    assert again.delivery.id == delivery_id and again.delivery.next_at > 0
    return delivery_id


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_a_retry_leaves_a_delivery_being_sent_to_its_attempt(store: Store) -> None:
    bound(store, "hook", answers=1)
    bound(store, "down", answers=1)

    sending = claimed_again(store, "hook", 60.0)
    before = store.deliveries.get(sending)
    assert before is not None and before.claimed_by == OWNER
    assert store.deliveries.retry(sending) == before  # the attempt decides: nothing changed
    assert store.deliveries.get(sending) == before
    # Its attempt's verdict stands (a retry cannot put a backoff'd delivery due meanwhile).
    assert store.deliveries.finish(sending, OWNER, DeliveryStatus.PENDING, next_in=100.0)
    after = store.deliveries.get(sending)
    assert after is not None and after.next_at >= before.next_at + 99

    ran_out = claimed_again(store, "down", -1.0)  # its daemon died: the claim is over
    retried = store.deliveries.retry(ran_out)
    assert retried is not None and retried.next_at == 0.0
    assert (retried.status, retried.attempts) == ("pending", 1)
    assert store.deliveries.get(ran_out) == retried
    # Another daemon takes it at once.
    assert [o.delivery.id for o in store.deliveries.claim("host-u/boot0001", {"down": 60}, 10)] == [
        ran_out
    ]


# --- metrics count what was written ---------------------------------------------------


@pytest.mark.usefixtures("secrets")
def test_an_attempt_whose_verdict_was_not_kept_is_not_counted(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = bound(store, answers=1)
    finish, release = store.deliveries.finish, store.deliveries.release
    lost: list[bool] = []

    def claim_lost_first(*args: Any, **kwargs: Any) -> bool:
        if not lost:  # the claim ran out and was given up meanwhile: nothing is written
            release(OWNER)
        kept = finish(*args, **kwargs)
        lost.append(not kept)
        return kept

    monkeypatch.setattr(store.deliveries, "finish", claim_lost_first)

    async def main() -> None:
        courier, watch, metrics = make(store, Target(lambda request, body, n: 200))
        async with running(courier):
            await watch.until(lambda: len(watch.outcomes) == 2)
        assert lost == [True, False]  # sent again, the second verdict kept
        assert attempts(metrics) == {"delivered": 1.0, "failed": 0.0, "dead": 0.0}
        get = metrics.registry.get_sample_value
        assert get("turnkeeper_delivery_lag_seconds_count") == 1

    asyncio.run(main())
    [d] = rows(store, sid)
    assert (d.status, d.attempts) == ("delivered", 1)


# --- what is carried ------------------------------------------------------------------


def test_a_cut_answer_is_an_answer_and_a_turn_ended_carries_its_outcome() -> None:
    cut = {"text": "the first part", "finish_reason": "length", "tool_calls": []}
    assert kind_of("model_response", cut) == "answer"
    assert kind_of("model_response", {"text": "done", "finish_reason": "stop"}) == "answer"
    calls = {"text": "", "tool_calls": [{"id": "c1", "name": "echo", "arguments": {}}]}
    assert kind_of("model_response", calls) is None
    assert kind_of("model_response", calls | {"finish_reason": "length"}) is None
    assert text_of("turn_ended", {"outcome": "completed"}) == "completed"
    assert text_of("turn_ended", {"outcome": "truncated", "text": "x"}) == "truncated"
    assert text_of("answer", {"text": "hello", "summary": "s", "outcome": "o"}) == "hello"
    assert text_of("notice", {"summary": "a summary"}) == "a summary"
    assert text_of("notice", {"text": 3}) == ""


@pytest.mark.usefixtures("secrets")
def test_a_cut_answer_and_a_turns_outcome_are_delivered(store: Store) -> None:
    target = Target(lambda request, body, n: 200)
    sid = store.sessions.create("alice").id
    store.deliveries.bind(sid, "hook", ["answer", "turn_ended"])
    cut = {"text": "the first part", "finish_reason": "length", "tool_calls": []}
    first = store.events.append(sid, "model_response", cut)
    tool = {"name": "echo", "id": "c1", "arguments": {}}
    store.events.append(sid, "model_response", {"text": "", "tool_calls": [tool]})
    rest = answer(store, sid, "and the rest")
    ended = store.events.append(sid, "turn_ended", {"outcome": "completed"}, turn_id="t1")

    async def main() -> None:
        courier, watch, _ = make(store, target)
        async with running(courier):
            await watch.until(lambda: watch.count(AttemptOutcome.DELIVERED) == 3)

    asyncio.run(main())
    sent = [json.loads(r.content) for r in target.requests]
    assert [(b["seq"], b["type"], b["text"]) for b in sent] == [
        (first, "answer", "the first part"),
        (rest, "answer", "and the rest"),
        (ended, "turn_ended", "completed"),
    ]


# --- who may bind a session to a target -----------------------------------------------


def test_a_target_naming_its_principals_is_bound_to_by_them_and_the_admin_only(
    start: Callable[..., Api],
) -> None:
    delivery = delivery_config(free_port(), sink=free_port())
    delivery["targets"][0]["principals"] = ["alice"]  # bridge: alice's; sink: anyone's
    api = start(delivery=delivery)
    admin, alice, bob = api.client("admin"), api.client("alice"), api.client("bob")

    made = alice.post("/v1/sessions", json={"deliver_to": "bridge"})
    assert made.status_code == 201 and made.json()["deliver_to"] == "bridge", made.text
    mine = create_session(alice)
    assert bind(alice, mine, "bridge").json()["deliver_to"] == "bridge"

    error = assert_error(bob.post("/v1/sessions", json={"deliver_to": "bridge"}), 403, "forbidden")
    assert error["field"] == "deliver_to" and "'bridge'" in error["message"]
    assert bob.get("/v1/sessions").json()["sessions"] == []  # the refused create made none
    his = create_session(bob)
    error = assert_error(bind(bob, his, "bridge"), 403, "forbidden")
    assert error["field"] == "deliver_to" and "'bob'" in error["message"]
    assert bob.get(f"/v1/sessions/{his}").json()["deliver_to"] is None
    assert bind(bob, his, "sink").json()["deliver_to"] == "sink"  # a target with no list

    assert bind(admin, his, "bridge").json()["deliver_to"] == "bridge"  # the admin may
    made = admin.post("/v1/sessions", json={"deliver_to": "bridge"})
    assert made.status_code == 201, made.text
    # Taking a session away from a target that lists its principals needs to be one.
    error = assert_error(bind(bob, his, None), 403, "forbidden")
    assert "'bridge'" in error["message"]
    assert bind(admin, his, None).json()["deliver_to"] is None
    with api.store() as store:
        assert store.sessions.get(his).deliver_to is None
        assert store.sessions.get(mine).deliver_to == "bridge"


# --- the secret stays with the supervisor ----------------------------------------------


class EnvAgent:
    """Says, as a notice, whether the worker it runs in can read the target's secret."""

    async def run_turn(self, turn: Turn) -> str:
        seen = {name: name in os.environ for name in (SEEN, VISIBLE)}
        await turn.notice(json.dumps(seen, sort_keys=True))
        return "completed"


def test_a_worker_drops_every_targets_secret_while_the_supervisor_signs(
    daemons: Callable[..., Daemon], tmp_path: Path
) -> None:
    receiver = Receiver("the guarded secret").start()
    try:
        daemon = daemons(
            agent={"class": f"{__name__}:EnvAgent"},
            delivery={
                "poll_interval": 0.1,
                "targets": [{"name": "hook", "url": receiver.url, "secret_env": SEEN}],
            },
        )
        daemon.env.update({SEEN: "the guarded secret", VISIBLE: "yes"})
        daemon.start()
        with daemon.client() as client:
            made = client.post("/v1/sessions", json={"deliver_to": "hook"})
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            inject(client, sid, "what do you see?")
        wait_until(lambda: receiver.records, 60, "the agent's notice at the receiver")
        [notice] = receiver.records
        assert notice.verified, "the supervisor did not sign with the secret"
        assert notice.document["type"] == "notice" and notice.document["session"] == sid
        assert json.loads(notice.document["text"]) == {SEEN: False, VISIBLE: True}
    finally:
        receiver.close()
