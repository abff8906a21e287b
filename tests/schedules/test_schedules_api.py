"""The schedules' routes in-process (the API on a real SQLite file, no daemon): who may make,
read and delete a schedule (its session's ACL), the shapes of the answers and their
OpenAPI document, and bad input answered with the field it is about. Firing them is
test_schedules_daemon.py's (a real daemon) and test_schedules_store.py's."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract.config import Config
from supervisor.http import openapi
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.store import Store

PRINCIPALS = ("admin", "alice", "bob")


class Caller:
    """One principal's requests to the in-process API."""

    def __init__(self, client: TestClient, principal: str) -> None:
        self.client, self.headers = client, {"Authorization": f"Bearer {principal}-token"}

    async def call(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        answer: ClientResponse = await self.client.request(
            method, path, headers=self.headers, **kwargs
        )
        body = await answer.json()
        if answer.status == 201:
            assert answer.headers["Location"] == f"/v1/schedules/{body['id']}"
        return answer.status, body

    async def make(self, **body: Any) -> dict[str, Any]:
        status, made = await self.call("POST", "/v1/schedules", json={"text": "hi", **body})
        assert status == 201, made
        return dict(made)

    async def ids(self) -> list[str]:
        status, found = await self.call("GET", "/v1/schedules")
        assert status == 200, found
        return [s["id"] for s in found["schedules"]]


Scenario = Callable[[Store, Api, dict[str, Caller]], Awaitable[None]]


def run(tmp_path: Path, scenario: Scenario, **config: Any) -> None:
    """`scenario` against the API over a fresh database, one caller per principal."""
    with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        tokens = Tokens({p: digest(f"{p}-token") for p in PRINCIPALS})
        api = Api(Config(**config), store, Hub(), tokens, Metrics(), boot_id="b" * 32)

        async def main() -> None:
            async with TestClient(TestServer(api.app())) as client:
                await scenario(store, api, {p: Caller(client, p) for p in PRINCIPALS})

        asyncio.run(main())


def test_a_schedule_on_a_session_follows_its_acl(tmp_path: Path) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        alice, bob, admin = who["alice"], who["bob"], who["admin"]
        session = store.sessions.create("alice").id
        before = time.time()
        made = await alice.make(cron="*/5 * * * *", session=session, timezone="Europe/Paris")
        assert made["id"].startswith("s") and made["owner"] == "alice"
        assert (made["cron"], made["timezone"], made["misfire"]) == (
            "*/5 * * * *",
            "Europe/Paris",
            "run_once",
        )
        assert made["session"] == session and made["last_fire"] is None
        assert before < made["next_fire_at"] <= before + 300 and made["next_fire_at"] % 300 == 0
        one = f"/v1/schedules/{made['id']}"
        assert await alice.call("GET", one) == (200, made)
        # Bob cannot read the session: the schedule does not exist for him.
        assert await bob.ids() == []
        status, error = await bob.call("GET", one)
        assert (status, error["error"]["code"]) == (404, "not_found")
        status, error = await bob.call("POST", "/v1/schedules", json={
            "cron": "* * * * *", "text": "x", "session": session,
        })  # fmt: skip
        assert (status, error["error"]["field"]) == (422, "session")
        # Read access: he sees it, and may neither delete it nor make one on the session.
        store.acl.grant(session, "bob", "read")
        assert await bob.ids() == [made["id"]]
        assert (await bob.call("GET", one))[0] == 200
        status, error = await bob.call("DELETE", one)
        assert status == 403 and "bob has read access" in error["error"]["message"]
        status, error = await bob.call("POST", "/v1/schedules", json={
            "cron": "* * * * *", "text": "x", "session": session,
        })  # fmt: skip
        assert status == 403 and error["error"]["code"] == "forbidden"
        assert "a schedule on it needs write" in error["error"]["message"]
        # Write access: both.
        store.acl.grant(session, "bob", "write")
        his = await bob.make(cron="0 9 * * 1-5", session=session, misfire="skip")
        assert await alice.ids() == [made["id"], his["id"]]
        assert await admin.ids() == [made["id"], his["id"]]
        assert await bob.call("DELETE", one) == (200, {"id": made["id"], "deleted": True})
        assert (await bob.call("DELETE", one))[0] == 404
        assert await alice.ids() == [his["id"]]
        assert store.schedules.get(made["id"]) is None

    run(tmp_path, scenario)


def test_a_schedule_without_a_session_is_its_owners(tmp_path: Path) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        alice, bob, admin = who["alice"], who["bob"], who["admin"]
        made = await alice.make(cron="*/2 * * * * *", session=None, misfire="skip")
        assert made["session"] is None and made["owner"] == "alice"
        assert made["next_fire_at"] == pytest.approx(time.time(), abs=2.1)
        assert await bob.ids() == [] and await admin.ids() == [made["id"]]
        one = f"/v1/schedules/{made['id']}"
        assert (await bob.call("DELETE", one))[0] == 404
        # Its last fire shows in what is read back.
        store.schedules.record(made["id"], [(1_800_000_000.0, "skipped", "misfire skip")], "h")
        status, found = await alice.call("GET", one)
        assert status == 200 and found["last_fire"] == {
            "scheduled_for": 1_800_000_000.0,
            "outcome": "skipped",
            "session": None,
            "seq": None,
            "fired_at": found["last_fire"]["fired_at"],
            "reason": "misfire skip",
        }
        assert (await admin.call("DELETE", one))[0] == 200

    run(tmp_path, scenario, schedules={"min_interval": 2})


BAD = [
    ({"cron": "61 * * * *"}, "cron", "'61 * * * *' is not a cron expression: Bad minute"),
    ({"cron": "* * * *"}, "cron", "Wrong number of fields; 5 fields"),
    ({"cron": ""}, "cron", "at least 1 character"),
    ({"timezone": "Mars/Olympus"}, "timezone", "unknown time zone 'Mars/Olympus'"),
    ({"misfire": "sometimes"}, "misfire", "'run_once' or 'skip'"),
    ({"session": uuid.uuid4().hex}, "session", "no session"),
    ({"session": "not-an-id"}, "session", "should match pattern"),
    ({"text": ""}, "text", "at least 1 character"),
    ({"every": "day"}, "every", "Extra inputs are not permitted"),
]


@pytest.mark.parametrize(
    ("change", "field", "says"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)]
)
def test_bad_input_names_the_field(
    tmp_path: Path, change: dict[str, Any], field: str, says: str
) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        body = {"cron": "* * * * *", "text": "x", **change}
        status, answer = await who["alice"].call("POST", "/v1/schedules", json=body)
        assert status == 422, answer
        error = answer["error"]
        assert (error["code"], error["field"]) == ("invalid", field)
        assert error["message"].startswith(f"{field}: ") and says in error["message"]
        assert store.schedules.visible() == []

    run(tmp_path, scenario)


def test_what_cannot_be_made_says_why(tmp_path: Path) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        alice = who["alice"]
        body = {"cron": "* * * * *", "text": "x"}
        status, error = await alice.call("POST", "/v1/schedules", data=b"{nope")
        assert (status, error["error"]["code"]) == (400, "malformed_json")
        closed = store.sessions.create("alice").id
        store.sessions.close(closed, "alice")
        status, error = await alice.call("POST", "/v1/schedules", json={**body, "session": closed})
        assert (status, error["error"]["code"]) == (409, "closed")
        await alice.make(**body)
        status, error = await alice.call("POST", "/v1/schedules", json=body)
        assert (status, error["error"]["code"]) == (409, "too_many_schedules")
        assert "schedules.max_schedules" in error["error"]["message"]
        status, error = await alice.call("GET", "/v1/schedules/nope")
        assert (status, error["error"]["code"]) == (404, "not_found")
        status, error = await alice.call("GET", "/v1/schedules", params={"limit": "0"})
        assert (status, error["error"]["field"]) == (422, "limit")
        api.stopping = True
        status, error = await alice.call("POST", "/v1/schedules", json=body)
        assert (status, error["error"]["code"]) == (503, "stopping")

    run(tmp_path, scenario, schedules={"max_schedules": 2})  # alice's share: 1 of 2


@pytest.mark.parametrize(
    ("least", "refused", "allowed"),
    [
        (60.0, {"* * * * * *": 1, "*/30 * * * * *": 30, "0,59 * * * * *": 1}, ["0 * * * * *"]),
        (2.0, {"* * * * * *": 1, "0,1 */5 * * * *": 1}, ["*/2 * * * * *", "* * * * *"]),
        (0.0, {}, ["* * * * * *"]),
    ],
)
def test_a_schedule_fires_no_more_often_than_min_interval(
    tmp_path: Path, least: float, refused: dict[str, int], allowed: list[str]
) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        for cron, gap in refused.items():
            body = {"cron": cron, "text": "x", "session": None}
            status, answer = await who["alice"].call("POST", "/v1/schedules", json=body)
            assert status == 422, answer
            error = answer["error"]
            assert (error["code"], error["field"]) == ("invalid", "cron")
            assert error["message"] == (
                f"cron: {cron!r} runs {gap} s apart, more often than schedules.min_interval "
                f"allows (at least {least:g} s between two runs)"
            )
        for cron in allowed:
            await who["alice"].make(cron=cron, session=None)
        assert len(store.schedules.visible()) == len(allowed)

    run(tmp_path, scenario, schedules={"min_interval": least})


def test_one_principal_cannot_use_up_everyones_schedules(tmp_path: Path) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        alice, bob = who["alice"], who["bob"]
        first = await alice.make(cron="0 9 * * *")
        await alice.make(cron="0 10 * * *")
        status, error = await alice.call(
            "POST", "/v1/schedules", json={"cron": "0 11 * * *", "text": "x"}
        )
        assert (status, error["error"]["code"]) == (409, "too_many_own_schedules")
        assert error["error"]["message"] == (
            "alice has made 2 schedules already (schedules.max_per_owner); delete one of them first"
        )
        await bob.make(cron="0 11 * * *")  # his own room
        assert (await alice.call("DELETE", f"/v1/schedules/{first['id']}"))[0] == 200
        await alice.make(cron="0 11 * * *")

    run(tmp_path, scenario, schedules={"max_per_owner": 2})


def test_schedules_turned_off_are_refused(tmp_path: Path) -> None:
    async def scenario(store: Store, api: Api, who: dict[str, Caller]) -> None:
        body = {"cron": "* * * * *", "text": "x"}
        status, error = await who["admin"].call("POST", "/v1/schedules", json=body)
        assert (status, error["error"]["code"]) == (409, "schedules_off")

    run(tmp_path, scenario, schedules={"max_schedules": 0})


def test_the_routes_are_in_the_openapi_document() -> None:
    paths = openapi.document()["paths"]
    assert set(paths["/v1/schedules"]) == {"get", "post"}
    assert set(paths["/v1/schedules/{id}"]) == {"get", "delete"}
    schemas = openapi.document()["components"]["schemas"]
    body = schemas["CreateSchedule"]
    assert set(body["properties"]) == {"cron", "text", "session", "timezone", "misfire"}
    assert body["required"] == ["cron", "text"]
    assert set(schemas["ScheduleOut"]["properties"]) >= {"next_fire_at", "last_fire", "owner"}
