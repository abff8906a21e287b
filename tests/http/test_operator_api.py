"""The API pieces an operator's console reads and does, against a real daemon: sessions
found by text and state a page at a time, each with the caller's permission; the boot
log and a breaker reset (admin only); a schedule held and resumed by whoever may delete
it."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.daemon import daemons, turnkeeper, wait_until
from tests.http.test_api import Api, create_session, grant, start

__all__ = ["daemons", "start"]


def ids(answer: dict[str, object]) -> list[str]:
    return [s["id"] for s in answer["sessions"]]  # type: ignore[attr-defined, index]


@pytest.mark.timeout(120)
def test_sessions_are_found_by_text_and_state_a_page_at_a_time(start: Callable[..., Api]) -> None:
    api = start()
    admin, alice, bob = api.client(), api.client("alice"), api.client("bob")
    made = [create_session(alice, title=f"nightly report {i}") for i in range(5)]
    other = create_session(alice, title="Billing <b>bot</b>")
    closed = create_session(alice, title="old report")
    assert admin.delete(f"/v1/sessions/{closed}").status_code == 200
    grant(alice, made[0], "bob", "read")

    # By text: a title contains it (any case), or an id starts with it.
    found = alice.get("/v1/sessions", params={"q": "REPORT"}).json()
    assert set(ids(found)) == {*made, closed}
    assert ids(alice.get("/v1/sessions", params={"q": other[:8]}).json()) == [other]
    assert ids(alice.get("/v1/sessions", params={"q": "<b>"}).json()) == [other]
    assert ids(alice.get("/v1/sessions", params={"q": "%"}).json()) == []  # no wildcard

    # By state.
    assert ids(admin.get("/v1/sessions", params={"status": "closed"}).json()) == [closed]
    open_ = admin.get("/v1/sessions", params={"status": "open,quarantined"}).json()
    assert closed not in ids(open_) and set(made) <= set(ids(open_))

    # A page at a time, newest first, every session once.
    pages, offset = [], 0
    while offset is not None:
        page = alice.get("/v1/sessions", params={"limit": 3, "offset": offset}).json()
        pages.append(ids(page))
        offset = page["next_offset"]
    assert [len(p) for p in pages] == [3, 3, 1]
    assert [s for page in pages for s in page] == [closed, other, *reversed(made)]

    # The last active first: a message makes made[0] the newest by activity.
    assert alice.post(f"/v1/sessions/{made[0]}/inject", json={"text": "hi"}).status_code == 202
    by_activity = alice.get("/v1/sessions", params={"order": "activity", "limit": 1}).json()
    assert ids(by_activity) == [made[0]]

    # Each with the caller's permission: what a client may offer, not what it may do.
    assert {s["permission"] for s in alice.get("/v1/sessions").json()["sessions"]} == {"admin"}
    (seen,) = bob.get("/v1/sessions").json()["sessions"]
    assert (seen["id"], seen["permission"]) == (made[0], "read")
    assert bob.get(f"/v1/sessions/{made[0]}").json()["permission"] == "read"
    assert admin.get(f"/v1/sessions/{made[0]}").json()["permission"] == "admin"
    assert bob.post(f"/v1/sessions/{made[0]}/inject", json={"text": "x"}).status_code == 403
    assert seen["waiting"] is None and seen["quarantined_at"] is None
    # The worker holding its lease (host, boot, slot) is the admin token's to see only.
    held = wait_until(lambda: admin.get(f"/v1/sessions/{made[0]}").json()["owner"], 30, "its lease")
    assert held.count("/") == 2, held
    assert alice.get(f"/v1/sessions/{made[0]}").json()["owner"] is None
    assert seen["owner"] is None

    for params, field in (
        ({"status": "sleeping"}, "status"),
        ({"order": "random"}, "order"),
        ({"offset": "-1"}, "offset"),
        ({"q": "x" * 201}, "q"),
    ):
        answer = alice.get("/v1/sessions", params=params)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"]["field"] == field


@pytest.mark.timeout(120)
def test_the_boot_log_and_a_breaker_reset_are_the_admins(start: Callable[..., Api]) -> None:
    api = start()
    admin, alice = api.client(), api.client("alice")
    boots = admin.get("/v1/boots").json()
    status = admin.get("/v1/status").json()
    newest = boots["boots"][0]
    assert newest["boot_id"] == status["boot"]["id"]
    assert (newest["state"], newest["outcome"], newest["host"]) == ("running", None, boots["host"])
    assert alice.get("/v1/boots").status_code == 403

    reset = admin.post("/v1/breaker/reset")
    assert reset.status_code == 200, reset.text
    assert reset.json()["host"] == boots["host"]
    kept = admin.get("/v1/boots").json()["boots"][0]["breaker"]
    assert kept["reset_at"] == reset.json()["reset_at"]
    assert alice.post("/v1/breaker/reset").status_code == 403


@pytest.mark.timeout(120)
def test_a_schedule_is_held_and_resumed_by_whoever_may_delete_it(
    start: Callable[..., Api],
) -> None:
    api = start()
    alice, bob = api.client("alice"), api.client("bob")
    session = create_session(alice, title="scheduled")
    grant(alice, session, "bob", "read")
    made = alice.post(
        "/v1/schedules", json={"cron": "0 3 * * *", "text": "report", "session": session}
    ).json()
    path = f"/v1/schedules/{made['id']}"

    held = alice.post(f"{path}/pause")
    assert held.status_code == 200, held.text
    assert (held.json()["status"], held.json()["next_fire_at"]) == ("held", None)
    assert alice.post(f"{path}/pause").json()["status"] == "held"  # again: no error
    assert alice.get(path).json()["status"] == "held"

    assert bob.post(f"{path}/resume").status_code == 403  # read access only
    assert bob.get(path).json()["status"] == "held"

    resumed = alice.post(f"{path}/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "active" and resumed.json()["next_fire_at"] is not None

    # The command line does the same through the API (the admin token).
    paused = turnkeeper(api.daemon, "schedules", "pause", made["id"])
    assert paused.returncode == 0, paused.stderr
    listed = turnkeeper(api.daemon, "schedules", "list")
    assert " held " in listed.stdout, listed.stdout
    again = turnkeeper(api.daemon, "schedules", "resume", made["id"], "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"] == "active"

    assert alice.delete(f"/v1/sessions/{session}").status_code == 200  # the schedule ends
    ended = alice.post(f"{path}/pause")
    assert ended.status_code == 409 and "ended" in ended.json()["error"]["message"]
    assert alice.post("/v1/schedules/0123/pause").status_code == 404
