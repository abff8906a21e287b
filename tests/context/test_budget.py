"""Token budgets (issue 29): the rules without I/O, and a real daemon whose session
spends its `budget.session_tokens`: the turn that would pass it ends `budget_exhausted`
with a notice, the count survives a restart, and /metrics counts the tokens."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from supervisor.store import EventRecord, Store
from tests.daemon import Daemon, daemons, events, turn_ended, wait_until
from workers.budget import Budget, BudgetExhausted, Spend, answer_cost, spent_by

__all__ = ["daemons"]

Daemons = Callable[..., Daemon]


def test_a_call_that_would_pass_a_budget_is_refused_saying_what_was_spent() -> None:
    budget = Budget(turn_limit=100, session_limit=1000, max_tokens=10, session=500)
    budget.check(90)
    budget.spent.add(60, 20)
    with pytest.raises(BudgetExhausted, match=r"budget\.turn_tokens \(100\).*spent 80 tokens"):
        budget.check(30)
    assert budget.payload() == {"prompt": 60, "completion": 20, "turn": 80, "session": 580}
    session = Budget(session_limit=600, earlier=Spend(10, 5), session=580)
    with pytest.raises(BudgetExhausted, match=r"budget\.session_tokens \(600\)"):
        session.check(10)
    Budget().check(10**9)  # no limits


def test_what_an_answer_cost_is_the_servers_count_else_the_estimate() -> None:
    counted = {"usage": {"prompt_tokens": 7, "completion_tokens": 3}, "prompt_estimate": 99}
    assert answer_cost(counted) == (7, 3)
    assert answer_cost({"usage": {}, "prompt_estimate": 12, "tokens": 4}) == (12, 4)
    events = [
        EventRecord("s", 1, "model_response", "t", counted, 0.0, "w"),
        EventRecord("s", 2, "tool_result", "t", {"content": "x"}, 0.0, "w"),
    ]
    assert spent_by(events) == Spend(7, 3)


def sample(metrics: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    head = f"{name}{{{wanted}}} "
    found = [line for line in metrics.splitlines() if line.startswith(head)]
    return float(found[0].split()[-1]) if found else 0.0


@pytest.mark.timeout(180)
def test_a_session_that_spent_its_budget_ends_its_turns_budget_exhausted(
    daemons: Daemons,
) -> None:
    daemon = daemons(budget={"session_tokens": 600}, model={"max_tokens": 40}).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "budget"}).json()["id"]

        def send(text: str) -> EventRecord:
            seq = api.post(f"/v1/sessions/{session}/inject", json={"text": text}).json()["seq"]
            return wait_until(lambda: turn_ended(store, session, seq), 60, f"the turn {text!r}")

        totals: list[int] = []
        for index in range(40):
            ended = send(f"/big {10 + index}")
            if ended.payload["outcome"] == "budget_exhausted":
                break
            assert ended.payload["outcome"] == "completed"
            totals.append(ended.payload["tokens"]["session"])
        else:
            pytest.fail("the budget was never reached")
        assert totals == sorted(totals) and totals[-1] <= 600
        assert "budget.session_tokens (600)" in ended.payload["error"]
        [notice] = [
            e for e in events(store, session) if e.type == "notice" and e.turn_id == ended.turn_id
        ]
        assert "budget.session_tokens" in notice.payload["text"]
        assert f"the session {totals[-1]}" in notice.payload["text"]
        metrics = api.get("/metrics").text
        assert sample(metrics, "turnkeeper_model_tokens_total", kind="prompt") > 0
        assert sample(metrics, "turnkeeper_model_tokens_total", kind="completion") > 0

    # The count is in the log, not in a worker: after a restart the session is still spent.
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0
    daemon.start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        seq = api.post(f"/v1/sessions/{session}/inject", json={"text": "more"}).json()["seq"]
        again = wait_until(lambda: turn_ended(store, session, seq), 60, "the turn after")
        assert again.payload["outcome"] == "budget_exhausted"
        assert again.payload["tokens"]["session"] == totals[-1]
