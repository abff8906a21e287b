"""Schemathesis drives a real daemon on loopback from the daemon's own /openapi.json.

Every operation is called with generated input (valid and invalid), with the operator's
token, and each answer must be no 5xx, a status code the document lists, the content type
it lists, and a body matching its schema. Path ids are drawn mostly from real sessions
created first, so the fuzzing reaches past the 404 of an unknown id.

`GET /v1/sessions/{id}/attach` is left out: on a real session it is an endless event
stream, which this one-request-one-answer runner cannot judge. tests/http/test_api.py covers it.

The daemon has to run before the schema can be loaded from it, so the schema comes from a
module fixture. Schemathesis' own lazy loader (`schemathesis.pytest.from_fixture` with
`@schema.parametrize()`) fails under pytest 9 (it reads `request.node._nodeid`, which pytest 9
removed), so each operation is a plain parametrized hypothesis test drawing its cases from
`operation.as_strategy()`: the fuzzing phase, without the examples and coverage phases.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from supervisor.http import openapi
from tests.daemon import Daemon
from tests.http.test_api import free_port
from tests.support import plain

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SEEDED_SESSIONS = 3
ATTACH = "/v1/sessions/{id}/attach"
# Valid requests to these would restart the daemon, or replace its workers, under the fuzzer:
# their bodies are checked by tests/restarts/test_restart_api.py and tests/test_reload_*.py.
LIFECYCLE = frozenset({("/v1/restart", "post"), ("/v1/reload", "post")})
DOCUMENT = openapi.document()  # checked against the served one below


def _cases() -> list[Any]:
    """(path, method, mode) for every operation; negative only where there is input to spoil."""
    cases = []
    for path, operations in DOCUMENT["paths"].items():
        for method, operation in operations.items():
            if path == ATTACH or (path, method) in LIFECYCLE:
                continue
            has_input = "parameters" in operation or "requestBody" in operation
            for mode in GenerationMode:
                if mode is GenerationMode.POSITIVE or has_input:
                    cases.append(pytest.param(path, method, mode, id=f"{method} {path} {mode}"))
    return cases


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, port: int) -> Iterator[Daemon]:
    """One daemon for the whole run, with the plain tool-loop agent (no /crash command)."""
    daemon = Daemon(
        tmp_path_factory.mktemp("fuzz"),
        http={"listen": f"127.0.0.1:{port}"},
        agent={"class": "workers.agents.tool_loop:ToolLoopAgent"},
    )
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.kill_everything()


@pytest.fixture(scope="module")
def base_url(daemon: Daemon, port: int) -> str:
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def auth(daemon: Daemon) -> dict[str, str]:
    return {"Authorization": f"Bearer {(daemon.state / 'admin.token').read_text().strip()}"}


@pytest.fixture(scope="module")
def session_ids(base_url: str, auth: dict[str, str]) -> list[str]:
    """Real sessions, one of them with some history."""
    with httpx.Client(base_url=base_url, transport=plain(), headers=auth, timeout=15) as client:
        ids = []
        for number in range(SEEDED_SESSIONS):
            answer = client.post("/v1/sessions", json={"title": f"seed {number}"})
            assert answer.status_code == 201, answer.text
            ids.append(answer.json()["id"])
        answer = client.post(f"/v1/sessions/{ids[0]}/inject", json={"text": "hello"})
        assert answer.status_code == 202, answer.text
    return ids


@pytest.fixture(scope="module")
def api_schema(base_url: str, session_ids: list[str]) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=15)
    schema.config.update(base_url=base_url)
    # Every request carries the operator's token (tests/http/test_api.py covers auth); generated
    # Authorization headers would turn most negative cases into plain 401s.
    schema.config.generation.update(with_security_parameters=False)

    def flatmap_path_parameters(
        context: schemathesis.HookContext, path_parameters: dict[str, Any]
    ) -> st.SearchStrategy[dict[str, Any]]:
        if not path_parameters or "id" not in path_parameters:
            return st.just(path_parameters)
        # Mostly a real session, so that the fuzzing gets past the 404 of an unknown id.
        real = st.sampled_from(session_ids)
        ids = st.one_of(real, st.just(path_parameters["id"]), real)
        return ids.map(lambda session_id: {**path_parameters, "id": session_id})

    schema.hook(flatmap_path_parameters)
    return schema


def test_the_served_document_is_the_one_parametrized_here(base_url: str) -> None:
    with httpx.Client(transport=plain(), timeout=15) as client:
        assert client.get(f"{base_url}/openapi.json").json() == DOCUMENT


@pytest.mark.parametrize(("path", "method", "mode"), _cases())
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_every_answer_matches_the_openapi_document(
    api_schema: schemathesis.BaseSchema,
    auth: dict[str, str],
    path: str,
    method: str,
    mode: GenerationMode,
    data: st.DataObject,
) -> None:
    case = data.draw(api_schema[path][method].as_strategy(generation_mode=mode))
    case.call_and_validate(headers=auth, checks=CHECKS, timeout=15)
