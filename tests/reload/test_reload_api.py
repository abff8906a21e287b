"""`POST /v1/reload` and the status's `config`, in this process on a real SQLite store,
with a reloader that records what it was asked: who may reload, the body, the answers of
an applied and a refused configuration (as the OpenAPI document's models say), and the
503s while the daemon starts or stops. (The fuzzer leaves this route out: a valid request
would replace a daemon's workers under it.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.contract.config import Config, config_version
from supervisor.core.reload import Change
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.http.reload_route import ReloadOut, ReloadRefused
from supervisor.http.schemas import ErrorBody, Status
from supervisor.metrics import Metrics
from supervisor.reloading import ReloadResult
from supervisor.store import Store

ADMIN = {"Authorization": "Bearer admin-token"}
ALICE = {"Authorization": "Bearer alice-token"}
APPLIED = ReloadResult(
    True,
    None,
    "95311db4df12",
    "1a2b3c4d5e6f",
    1700000000.0,
    [Change("pool.workers", 2, 3, "live"), Change("http.listen", "a:1", "a:2", "restart")],
    ["http.listen"],
    False,
)
REFUSED = ReloadResult(False, "pool.workers: too few [file x]", "95311db4df12", "95311db4df12", 1.0)


class Recorder:
    """A reloader that answers `result` and remembers what it was asked: (wait, workers)."""

    def __init__(self, result: ReloadResult) -> None:
        self.result = result
        self.asked: list[tuple[bool, bool]] = []
        self.version, self.loaded_at = result.version, result.loaded_at

    async def reload(self, *, wait: bool = True, workers: bool = False) -> ReloadResult:
        self.asked.append((wait, workers))
        return self.result


Check = Callable[[Api, TestClient], Any]


def serve(tmp_path: Path, check: Check, reloader: Recorder | None) -> None:
    async def run() -> None:
        with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
            tokens = Tokens({"admin": digest("admin-token"), "alice": digest("alice-token")})
            api = Api(Config(), store, Hub(), tokens, Metrics(), boot_id="b" * 32)
            api.reloader = reloader
            api.ready = True  # serving: a reload is taken (503 "starting" without a reloader)
            async with TestClient(TestServer(api.app())) as client:
                await check(api, client)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (None, (True, False)),
        ({}, (True, False)),
        ({"wait": True}, (True, False)),
        ({"wait": False}, (False, False)),
        ({"workers": True}, (True, True)),
    ],
)
def test_an_applied_reload_answers_what_changed(
    tmp_path: Path, body: dict[str, Any] | None, asked: tuple[bool, bool]
) -> None:
    reloader = Recorder(APPLIED)

    async def check(api: Api, client: TestClient) -> None:
        answer = await client.post("/v1/reload", json=body, headers=ADMIN)
        assert answer.status == 200, await answer.text()
        document = await answer.json()
        assert ReloadOut.model_validate(document).model_dump(mode="json") == document
        assert document == APPLIED.as_dict()

    serve(tmp_path, check, reloader)
    assert reloader.asked == [asked]


def test_a_refused_configuration_is_a_422_with_the_line_and_the_result(tmp_path: Path) -> None:
    async def check(api: Api, client: TestClient) -> None:
        answer = await client.post("/v1/reload", headers=ADMIN)
        assert answer.status == 422
        document = await answer.json()
        ReloadRefused.model_validate(document)
        assert document["error"]["code"] == "invalid_config"
        assert document["error"]["message"] == "pool.workers: too few [file x]"
        assert document["result"] == REFUSED.as_dict()

    serve(tmp_path, check, Recorder(REFUSED))


@pytest.mark.parametrize(
    ("code", "status", "error"), [("stopping", 503, "stopping"), ("failed", 500, "reload_failed")]
)
def test_a_reload_refused_by_the_daemon_not_the_file_is_no_422(
    tmp_path: Path, code: str, status: int, error: str
) -> None:
    """A stop begun meanwhile, or an error of the daemon's: not a configuration error (the
    CLI exits 78 only for one)."""
    refused = ReloadResult(False, "why", "95311db4df12", "95311db4df12", 1.0)
    refused.code = code

    async def check(api: Api, client: TestClient) -> None:
        answer = await client.post("/v1/reload", headers=ADMIN)
        assert answer.status == status
        assert (await answer.json())["error"] == {"code": error, "message": "why"}

    serve(tmp_path, check, Recorder(refused))


@pytest.mark.parametrize(
    ("headers", "data", "status", "code"),
    [
        (ALICE, b"", 403, "forbidden"),
        (ADMIN, b'{"wait": "no"}', 422, "invalid"),
        (ADMIN, b'{"wait": 1}', 422, "invalid"),
        (ADMIN, b'{"workers": "yes"}', 422, "invalid"),
        (ADMIN, b'{"soon": true}', 422, "invalid"),
        (ADMIN, b"{not json", 400, "malformed_json"),
        ({}, b"", 401, "unauthorized"),
    ],
)
def test_who_may_reload_and_what_body_it_takes(
    tmp_path: Path, headers: dict[str, str], data: bytes, status: int, code: str
) -> None:
    reloader = Recorder(APPLIED)

    async def check(api: Api, client: TestClient) -> None:
        answer = await client.post("/v1/reload", data=data, headers=headers)
        assert answer.status == status
        document = await answer.json()
        ErrorBody.model_validate(document)
        ReloadRefused.model_validate(document)  # a 422 is documented as this
        assert document["error"]["code"] == code

    serve(tmp_path, check, reloader)
    assert reloader.asked == []


def test_no_reload_while_the_daemon_starts_or_stops(tmp_path: Path) -> None:
    async def check(api: Api, client: TestClient) -> None:
        starting = await client.post("/v1/reload", headers=ADMIN)
        assert starting.status == 503 and (await starting.json())["error"]["code"] == "starting"
        api.reloader = reloader
        api.stopping = True
        stopping = await client.post("/v1/reload", headers=ADMIN)
        assert stopping.status == 503 and stopping.headers["Retry-After"]
        assert (await stopping.json())["error"]["code"] == "stopping"

    reloader = Recorder(APPLIED)
    serve(tmp_path, check, None)
    assert reloader.asked == []


def test_the_status_shows_the_configuration_in_force(tmp_path: Path) -> None:
    async def check(api: Api, client: TestClient) -> None:
        before = Status.model_validate(await (await client.get("/v1/status", headers=ADMIN)).json())
        assert before.config.version == config_version(Config())
        assert before.config.source is None  # the built-in defaults
        api.reloader = Recorder(APPLIED)
        after = Status.model_validate(await (await client.get("/v1/status", headers=ADMIN)).json())
        assert (after.config.version, after.config.loaded_at) == ("1a2b3c4d5e6f", 1700000000.0)

    serve(tmp_path, check, None)
