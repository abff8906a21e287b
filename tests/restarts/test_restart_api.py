"""The restart routes in-process (the API on a real SQLite file, no daemon): only the admin
may ask or read, a bad body is answered with the field it is about, and the desk's answers
(a new request, the one in progress, too soon, refused, none yet) become 202, 200, 429,
409 and 503. The desk is a fake that writes real rows through `store.restarts`; the
daemon's own desk and a real restart are tests/restarts/test_restart_daemon.py's."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract.config import Config
from supervisor.http import openapi
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.restarts.routes import RestartOut, RestartRefused
from supervisor.store import Store
from supervisor.store.models import RestartRequest
from supervisor.store.restarts import Admitted, RateLimited

HOST = "this-host"
BOOT = "b" * 32
NEXT_BOOT = "c" * 32
PID = 4242
ADMIN = {"Authorization": "Bearer admin-token"}
ALICE = {"Authorization": "Bearer alice-token"}


class Desk:
    """The daemon's desk, faked: records each call; writes a real row (restart.min_interval
    60 s), or raises what it is told to."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls: list[tuple[str, str, float | None]] = []
        self.raises: Exception | None = None

    async def request(self, *, by: str, reason: str, drain: float | None) -> Admitted:
        self.calls.append((by, reason, drain))
        if self.raises is not None:
            raise self.raises
        return await asyncio.to_thread(self.write, by, reason, drain, HOST)

    def write(self, by: str, reason: str, drain: float | None, host: str) -> Admitted:
        return self.store.restarts.request(
            host=host, boot=BOOT, pid=PID, by=by, reason=reason, drain=drain,
            version="0.9.0", config="ab12cd34ef56", min_interval=60.0,
        )  # fmt: skip


Scenario = Callable[[TestClient, Api, Desk], Awaitable[None]]


def run(tmp_path: Path, scenario: Scenario, *, desk: bool = True) -> None:
    """`scenario` against the API over a fresh database, with the fake desk attached."""
    with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        tokens = Tokens({p: digest(f"{p}-token") for p in ("admin", "alice")})
        api = Api(Config(), store, Hub(), tokens, Metrics(), boot_id=BOOT, host_id=HOST)
        fake = Desk(store)
        api.restarts = fake if desk else None

        async def main() -> None:
            async with TestClient(TestServer(api.app())) as client:
                await scenario(client, api, fake)

        asyncio.run(main())


async def call(
    client: TestClient, method: str, path: str, headers: dict[str, str] = ADMIN, **kwargs: Any
) -> tuple[int, Any, Any]:
    """Status, JSON body and headers of one request."""
    answer = await client.request(method, path, headers=headers, **kwargs)
    return answer.status, await answer.json(), answer.headers


def error(body: Any) -> tuple[str, str]:
    return body["error"]["code"], body["error"]["message"]


def test_only_the_admin_may_restart_or_read_the_requests(tmp_path: Path) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        made = desk.write("admin", "", None, HOST).info.id
        for method, path, what in (
            ("POST", "/v1/restart", "restart the daemon"),
            ("GET", "/v1/restarts", "list restart requests"),
            ("GET", f"/v1/restarts/{made}", "read restart requests"),
        ):
            status, body, _ = await call(client, method, path, ALICE, json={})
            assert status == 403, body
            assert error(body) == ("forbidden", f"only the admin principal may {what}")
        status, body, _ = await call(client, "POST", "/v1/restart", {}, json={})
        assert status == 401, body
        assert desk.calls == []

    run(tmp_path, scenario)


def test_a_request_is_admitted_and_a_second_is_answered_with_the_first(tmp_path: Path) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        body = {"reason": "  load the\tnew model\n", "drain": 30}
        status, first, _ = await call(client, "POST", "/v1/restart", json=body)
        assert status == 202, first
        assert first["in_progress"] is False
        made = first["restart"]
        assert set(made) == set(RestartOut.model_fields)
        assert (made["host"], made["boot"], made["pid"]) == (HOST, BOOT, PID)
        assert (made["requested_by"], made["reason"], made["drain"]) == (
            "admin",
            "load the new model",
            30.0,
        )
        assert (made["state"], made["outcome"], made["session"]) == ("pending", None, None)
        assert desk.calls == [("admin", body["reason"], 30.0)]

        status, second, _ = await call(client, "POST", "/v1/restart", json={"reason": "again"})
        assert status == 200, second
        assert second == {"restart": made, "in_progress": True}  # the first, as it is
        assert desk.calls[1] == ("admin", "again", None)

        # An empty object asks with no reason and the default drain.
        api.store.restarts.settle(made["id"], boot=NEXT_BOOT, version="0.9.0", config="x" * 12)
        with api.store.db.atomic():  # pretend the last request was long ago
            RestartRequest.update(requested_at=RestartRequest.requested_at - 600).execute()
        status, third, _ = await call(client, "POST", "/v1/restart", json={})
        assert status == 202, third
        assert (third["restart"]["reason"], third["restart"]["drain"]) == ("", None)
        assert desk.calls[2] == ("admin", "", None)

    run(tmp_path, scenario)


def test_a_request_too_soon_is_a_429_with_retry_after_in_whole_seconds(tmp_path: Path) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        status, first, _ = await call(client, "POST", "/v1/restart", json={})
        assert status == 202, first
        made = first["restart"]["id"]
        api.store.restarts.settle(made, boot=NEXT_BOOT, version="0.9.0", config="x" * 12)

        status, body, headers = await call(client, "POST", "/v1/restart", json={})
        assert status == 429, body
        code, message = error(body)
        assert code == "rate_limited"
        assert f"({made}); restart.min_interval is 60 s: try again in" in message
        assert 55 <= int(headers["Retry-After"]) <= 60

        # Retry-After is rounded up, and at least 1.
        last = api.store.restarts.get(made)
        assert last is not None
        for retry_after, header in ((0.2, "1"), (0.0, "1"), (59.01, "60"), (3.0, "3")):
            desk.raises = RateLimited(last, 60 - retry_after, 60.0, retry_after)
            status, body, headers = await call(client, "POST", "/v1/restart", json={})
            assert (status, headers["Retry-After"]) == (429, header), body

    run(tmp_path, scenario)


def test_a_refused_restart_is_a_409_and_a_missing_desk_a_503(tmp_path: Path) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        why = "the configuration does not load, so the daemon would not come back: bad key"
        desk.raises = RestartRefused(why)
        status, body, _ = await call(client, "POST", "/v1/restart", json={"reason": "x"})
        assert (status, error(body)) == (409, ("restart_refused", why))
        assert api.store.restarts.list() == []

        api.restarts = None
        status, body, headers = await call(client, "POST", "/v1/restart", json={})
        assert status == 503 and headers["Retry-After"] == "5"
        assert error(body)[0] == "restart_unavailable"
        assert len(desk.calls) == 1

    run(tmp_path, scenario)


def test_the_route_answers_while_the_daemon_is_stopping(tmp_path: Path) -> None:
    """Intake refuses once the daemon stops; a restart request still reaches the desk,
    which answers with the restart in progress (or refuses)."""

    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        api.stopping = True
        status, body, _ = await call(client, "POST", "/v1/sessions", json={})
        assert (status, error(body)[0]) == (503, "stopping")
        status, body, _ = await call(client, "POST", "/v1/restart", json={"reason": "now"})
        assert status == 202, body
        assert desk.calls == [("admin", "now", None)]

    run(tmp_path, scenario)


LONGEST = "r" * 500
BAD_BODIES = [
    ({"reason": 5}, "reason"),
    ({"reason": None}, "reason"),
    ({"reason": LONGEST + "r"}, "reason"),
    ({"drain": -1}, "drain"),
    ({"drain": 3600.5}, "drain"),
    ({"drain": "5"}, "drain"),
    ({"drain": True}, "drain"),
    ({"drain": [1]}, "drain"),
    ({"force": True}, "force"),
    ([], "body"),
    ("restart", "body"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[repr(b)[:30] for b, _ in BAD_BODIES])
def test_a_bad_body_is_a_422_naming_the_field(tmp_path: Path, body: Any, field: str) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        status, answer, _ = await call(client, "POST", "/v1/restart", json=body)
        assert status == 422, answer
        assert answer["error"]["field"] == field
        assert answer["error"]["message"].startswith(f"{field}: ")
        assert desk.calls == []

    run(tmp_path, scenario)


def test_a_body_that_is_not_json_is_a_400_and_the_limits_themselves_are_taken(
    tmp_path: Path,
) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        for raw in (b"", b"{", b'{"drain": NaN}', b'{"drain": Infinity}'):
            answer = await client.post("/v1/restart", data=raw, headers=ADMIN)
            body = await answer.json()
            if raw.startswith(b'{"drain"'):  # Python reads them; they are no finite number
                assert (answer.status, body["error"]["field"]) == (422, "drain"), body
            else:
                assert (answer.status, body["error"]["code"]) == (400, "malformed_json"), body
        assert desk.calls == []
        status, body, _ = await call(
            client, "POST", "/v1/restart", json={"reason": LONGEST, "drain": 3600}
        )
        assert status == 202, body
        assert desk.calls == [("admin", LONGEST, 3600.0)]

    run(tmp_path, scenario)


def test_the_requests_are_listed_newest_first_of_this_host_unless_all(tmp_path: Path) -> None:
    async def scenario(client: TestClient, api: Api, desk: Desk) -> None:
        store = api.store
        older = desk.write("admin", "first", None, HOST).info
        store.restarts.settle(older.id, boot=NEXT_BOOT, version="0.9.1", config="cd" * 6)
        elsewhere = desk.write("admin", "there", 5.0, "other-host").info
        with store.db.atomic():  # the first long ago, so the second is not too soon
            RestartRequest.update(requested_at=RestartRequest.requested_at - 600).where(
                RestartRequest.id == older.id
            ).execute()
        newer = desk.write("admin", "second", 1.5, HOST).info

        status, body, _ = await call(client, "GET", "/v1/restarts")
        assert status == 200, body
        assert [r["id"] for r in body["restarts"]] == [newer.id, older.id]
        settled = body["restarts"][1]
        assert (settled["state"], settled["outcome"]) == ("done", "failed")  # no boot log
        assert (settled["boot_after"], settled["version_after"]) == (NEXT_BOOT, "0.9.1")
        assert settled["seconds"] is not None and settled["settled_at"] is not None

        status, body, _ = await call(client, "GET", "/v1/restarts?all=true")
        assert [r["id"] for r in body["restarts"]] == [newer.id, elsewhere.id, older.id]
        status, body, _ = await call(client, "GET", "/v1/restarts?all=false&limit=1")
        assert [r["id"] for r in body["restarts"]] == [newer.id]
        for query, field in (("all=yes", "all"), ("limit=0", "limit"), ("limit=1001", "limit")):
            status, body, _ = await call(client, "GET", f"/v1/restarts?{query}")
            assert (status, body["error"]["field"]) == (422, field), body

        status, one, _ = await call(client, "GET", f"/v1/restarts/{elsewhere.id}")
        assert status == 200, one
        assert one == RestartOut.model_validate(elsewhere.as_dict()).model_dump(mode="json")
        for unknown in ("0" * 32, "nope", newer.id.upper()):
            status, body, _ = await call(client, "GET", f"/v1/restarts/{unknown}")
            assert (status, body["error"]["code"]) == (404, "not_found"), unknown

    run(tmp_path, scenario)


def test_the_openapi_document_describes_the_routes(tmp_path: Path) -> None:
    document = openapi.document()
    paths = document["paths"]
    post = paths["/v1/restart"]["post"]
    assert set(post["responses"]) == {"200", "202", "400", "401", "403", "409", "413", "422",
                                      "429", "503"}  # fmt: skip
    assert set(paths["/v1/restarts"]["get"]["responses"]) == {"200", "401", "403", "422"}
    assert set(paths["/v1/restarts/{id}"]["get"]["responses"]) == {"200", "401", "403", "404"}
    schemas = document["components"]["schemas"]
    body = schemas["RestartBody"]
    assert body["additionalProperties"] is False
    assert body["properties"]["reason"]["maxLength"] == 500
    shape = schemas["RestartOut"]
    assert set(shape["required"]) == set(shape["properties"]) == set(RestartOut.model_fields)
    with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        api = Api(Config(), store, Hub(), Tokens({}), Metrics(), boot_id=BOOT, host_id=HOST)
        routes = {
            (r.method.lower(), r.resource.canonical)
            for r in api.app().router.routes()
            if r.method != "HEAD" and r.resource is not None
        }
    documented = {(method, path) for path, operations in paths.items() for method in operations}
    assert routes == documented  # every route documented, nothing else
