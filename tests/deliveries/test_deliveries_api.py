"""Deliveries as a client sees them: binding a session to a target (`deliver_to` at
create, `PUT /v1/sessions/{id}`), the outbox (`GET /v1/deliveries`, one delivery, a
retry, a target's retry), their ACL, and the start check of a target's secret.

A real daemon runs, with one target, `bridge`. Its URL is a loopback port nobody listens
on, and `delivery.max_attempts` is 1: the first attempt at a delivery fails to connect
and makes it dead, so a dead delivery is there to list and retry without waiting for a
backoff. Delivered rows are made through the store (as the courier records one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon import Daemon, daemons, turn_ended, wait_until
from tests.http.test_api import Api, assert_error, create_session, free_port, inject, start_api

__all__ = ["daemons"]  # the fixture

SECRET_ENV = "TK_TEST_SECRET"
UNKNOWN_SESSION = "0" * 32
UNKNOWN_DELIVERY = "d" + "0" * 32


class Sink:
    """A target on loopback that answers every POST 204, and counts them."""

    def __init__(self) -> None:
        self.hits = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                sink.hits += 1
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def sink() -> Iterator[Sink]:
    receiver = Sink()
    yield receiver
    receiver.close()


def target(name: str, port: int) -> dict[str, str]:
    return {"name": name, "url": f"http://127.0.0.1:{port}/hook", "secret_env": SECRET_ENV}


def delivery_config(port: int, *, sink: int | None = None, **extra: Any) -> dict[str, Any]:
    """The `[delivery]` section: target `bridge` at `port` of loopback (nobody listens
    there), and `sink` at port `sink` if given; one attempt each."""
    targets = [target("bridge", port)] + ([target("sink", sink)] if sink is not None else [])
    return {"max_attempts": 1, "poll_interval": 0.1, "targets": targets, **extra}


@pytest.fixture
def start(daemons: Callable[..., Daemon], tmp_path: Path) -> Iterator[Callable[..., Api]]:
    """Start a daemon as tests/http/test_api.py's fixture does, its target's secret set."""
    made: list[Api] = []

    def with_secret(**sections: dict[str, Any]) -> Daemon:
        daemon = daemons(**sections)
        daemon.env[SECRET_ENV] = "s3cret"
        return daemon

    def make(**sections: dict[str, Any]) -> Api:
        sections.setdefault("delivery", delivery_config(free_port()))
        api = start_api(with_secret, tmp_path / f"api{len(made)}", **sections)
        made.append(api)
        return api

    yield make
    for api in made:
        api.close()


def bind(client: httpx.Client, session_id: str, target: str | None) -> httpx.Response:
    return client.put(f"/v1/sessions/{session_id}", json={"deliver_to": target})


def deliveries(client: httpx.Client, **query: Any) -> list[dict[str, Any]]:
    answer = client.get("/v1/deliveries", params=query)
    assert answer.status_code == 200, answer.text
    assert set(answer.json()) == {"deliveries"}
    found: list[dict[str, Any]] = answer.json()["deliveries"]
    return found


def test_a_session_is_bound_at_create_and_by_put_and_unbound_by_null(
    start: Callable[..., Api],
) -> None:
    api = start()
    alice = api.client("alice")

    created = alice.post("/v1/sessions", json={"deliver_to": "bridge"})
    assert created.status_code == 201, created.text
    assert created.json()["deliver_to"] == "bridge"
    bound = created.json()["id"]
    assert alice.get(f"/v1/sessions/{bound}").json()["deliver_to"] == "bridge"

    plain = create_session(alice)
    assert alice.get(f"/v1/sessions/{plain}").json()["deliver_to"] is None
    answer = bind(alice, plain, "bridge")
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == plain and answer.json()["deliver_to"] == "bridge"
    with api.store() as store:
        assert store.sessions.get(plain).deliver_to == "bridge"

    answer = bind(alice, plain, None)
    assert answer.status_code == 200, answer.text
    assert answer.json()["deliver_to"] is None
    listed = {s["id"]: s["deliver_to"] for s in alice.get("/v1/sessions").json()["sessions"]}
    assert listed == {bound: "bridge", plain: None}

    # Only a bound session's events are written to the outbox.
    seq = inject(alice, plain, "not delivered")
    inject(alice, bound, "delivered")
    wait_until(lambda: deliveries(alice, session=bound), 30, "a delivery of the bound session")
    with api.store() as store:
        wait_until(lambda: turn_ended(store, plain, seq), 30, "the unbound session's answer")
    assert deliveries(alice, session=plain) == []


def test_an_unknown_target_is_a_422_naming_the_field_and_the_configured_targets(
    start: Callable[..., Api],
) -> None:
    api = start()
    alice = api.client("alice")
    session = create_session(alice)
    for name in ("nowhere", "http://127.0.0.1:1/hook"):  # a name, never a URL
        for answer in (
            alice.post("/v1/sessions", json={"deliver_to": name}),
            bind(alice, session, name),
        ):
            error = assert_error(answer, 422, "invalid")
            assert error["field"] == "deliver_to"
            assert repr(name) in error["message"] and "bridge" in error["message"]
    assert alice.get(f"/v1/sessions/{session}").json()["deliver_to"] is None
    assert len(alice.get("/v1/sessions").json()["sessions"]) == 1  # the bad create made none

    for body in ({}, {"deliver_to": "bridge", "url": "http://127.0.0.1:1/"}, {"deliver_to": ""}):
        assert_error(alice.put(f"/v1/sessions/{session}", json=body), 422, "invalid")


def test_with_no_targets_a_name_is_refused_saying_where_targets_are_configured(
    start: Callable[..., Api],
) -> None:
    api = start(delivery={"targets": []})
    alice = api.client("alice")
    error = assert_error(alice.post("/v1/sessions", json={"deliver_to": "bridge"}), 422)
    assert error["field"] == "deliver_to"
    assert "none you may use" in error["message"]
    assert "[[delivery.targets]]" in error["message"]


def test_binding_needs_write_access_to_the_session(start: Callable[..., Api]) -> None:
    api = start()
    alice, bob = api.client("alice"), api.client("bob")
    session = create_session(alice)
    assert_error(bind(bob, session, "bridge"), 404, "not_found")  # bob cannot even read it
    granted = alice.put(
        f"/v1/sessions/{session}/acl", json={"principal": "bob", "permission": "read"}
    )
    assert granted.status_code == 200, granted.text
    assert_error(bind(bob, session, "bridge"), 403, "forbidden")
    assert alice.get(f"/v1/sessions/{session}").json()["deliver_to"] is None
    alice.put(f"/v1/sessions/{session}/acl", json={"principal": "bob", "permission": "write"})
    assert bind(bob, session, "bridge").json()["deliver_to"] == "bridge"
    assert_error(bind(api.client("admin"), UNKNOWN_SESSION, "bridge"), 404, "not_found")


def dead(client: httpx.Client, session_id: str) -> dict[str, Any]:
    """The session's one delivery, once its attempt failed and left it dead."""
    found: list[dict[str, Any]] = wait_until(
        lambda: deliveries(client, session=session_id, status="dead"),
        30,
        f"a dead delivery of {session_id}",
    )
    assert len(found) == 1, found
    return found[0]


def test_the_outbox_lists_by_status_and_session_and_a_retry_is_sent_at_once(
    start: Callable[..., Api], sink: Sink
) -> None:
    # The courier looks again by itself only every minute: what is sent within the test is
    # sent because an event was committed, or because the retry stirred it.
    api = start(delivery=delivery_config(free_port(), sink=sink.port, poll_interval=60))
    admin, alice = api.client("admin"), api.client("alice")
    refused = create_session(alice, deliver_to="bridge")
    assert deliveries(admin) == []
    inject(alice, refused, "hello")
    gone = dead(admin, refused)
    assert gone["target"] == "bridge" and gone["kind"] == "answer" and gone["attempts"] == 1
    assert gone["last_code"] is None and gone["last_error"] and gone["delivered_at"] is None

    taken = create_session(alice, deliver_to="sink")
    inject(alice, taken, "hello")
    done = wait_until(
        lambda: deliveries(admin, session=taken, status="delivered"), 30, "the sink's delivery"
    )[0]
    assert done["target"] == "sink" and done["attempts"] == 1 and done["delivered_at"]
    assert sink.hits == 1

    everything = deliveries(admin)
    assert [d["id"] for d in everything] == [done["id"], gone["id"]]  # newest first
    assert [d["id"] for d in deliveries(admin, limit=1)] == [done["id"]]
    assert [d["id"] for d in deliveries(admin, status="dead")] == [gone["id"]]
    assert [d["id"] for d in deliveries(admin, status="delivered")] == [done["id"]]
    assert deliveries(admin, status="pending") == []
    assert [d["id"] for d in deliveries(alice, session=refused)] == [gone["id"]]
    assert deliveries(alice, session=refused, status="delivered") == []
    for client in (admin, alice):
        one = client.get(f"/v1/deliveries/{gone['id']}")
        assert one.status_code == 200, one.text
        assert one.json() == gone

    assert_error(alice.post(f"/v1/deliveries/{gone['id']}/retry"), 403, "forbidden")
    assert_error(admin.post(f"/v1/deliveries/{UNKNOWN_DELIVERY}/retry"), 404, "not_found")
    assert_error(admin.post("/v1/deliveries/nonsense/retry"), 404, "not_found")
    error = assert_error(admin.post(f"/v1/deliveries/{done['id']}/retry"), 409, "delivered")
    assert "already delivered" in error["message"]

    retried = admin.post(f"/v1/deliveries/{gone['id']}/retry")
    assert retried.status_code == 200, retried.text
    assert retried.json()["id"] == gone["id"]
    assert retried.json()["status"] == "pending" and retried.json()["attempts"] == 0
    # Sent again within seconds, not at the next poll a minute away: the retry stirred the
    # courier. One attempt more (max_attempts 1) and it is dead again.
    again = dead(admin, refused)
    assert again["attempts"] == 1 and again["updated_at"] > gone["updated_at"]
    assert sink.hits == 1  # the delivered one was not sent twice

    document = api.client(None).get("/openapi.json").json()
    retry = document["paths"]["/v1/deliveries/{id}/retry"]["post"]
    assert retry["operationId"] == "retryDelivery" and "409" in retry["responses"]
    shape = document["components"]["schemas"]["DeliveryOut"]
    assert set(shape["required"]) == set(shape["properties"]) == set(gone)


def test_a_target_s_retry_revives_its_dead_deliveries_and_refuses_what_it_cannot(
    start: Callable[..., Api], sink: Sink
) -> None:
    api = start(delivery=delivery_config(free_port(), sink=sink.port))
    admin, alice = api.client("admin"), api.client("alice")
    refused = [create_session(alice, deliver_to="bridge") for _ in range(2)]
    for session in refused:
        inject(alice, session, "hello")
    gone = [dead(admin, session) for session in refused]
    taken = create_session(alice, deliver_to="sink")
    inject(alice, taken, "hello")
    wait_until(lambda: deliveries(admin, status="delivered"), 30, "the sink's delivery")

    path = "/v1/deliveries/retry"
    assert_error(alice.post(path, json={"target": "bridge"}), 403, "forbidden")
    error = assert_error(admin.post(path, json={"target": "nowhere"}), 409, "unknown_target")
    assert "'nowhere'" in error["message"] and "[[delivery.targets]]" in error["message"]
    for body in ({}, {"target": "Bridge!"}, {"target": "bridge", "all": True}):
        assert_error(admin.post(path, json=body), 422, "invalid")
    assert_error(admin.post(path, content=b"bridge"), 400, "malformed_json")

    retried = admin.post(path, json={"target": "bridge"})
    assert retried.status_code == 200, retried.text
    assert retried.json() == {"target": "bridge", "revived": 2, "due": 0}
    for before, session in zip(gone, refused, strict=True):
        again = dead(admin, session)  # sent, and failed, once more (max_attempts 1)
        assert again["attempts"] == 1 and again["updated_at"] > before["updated_at"]
    nothing = admin.post(path, json={"target": "sink"})  # its one delivery was delivered
    assert nothing.json() == {"target": "sink", "revived": 0, "due": 0}
    assert sink.hits == 1  # never sent twice

    document = api.client(None).get("/openapi.json").json()
    operation = document["paths"][path]["post"]
    assert operation["operationId"] == "retryTargetDeliveries"
    assert {"200", "403", "409", "422"} <= set(operation["responses"])
    shape = document["components"]["schemas"]["TargetRetried"]
    assert set(shape["properties"]) == {"target", "revived", "due"}


def test_deliveries_follow_their_sessions_acl(start: Callable[..., Api]) -> None:
    api = start()
    admin, alice, bob = api.client("admin"), api.client("alice"), api.client("bob")
    session = create_session(alice, deliver_to="bridge")
    inject(alice, session, "hello")
    row = dead(admin, session)
    path = f"/v1/deliveries/{row['id']}"

    assert_error(bob.get("/v1/deliveries"), 403, "forbidden")
    error = assert_error(alice.get("/v1/deliveries"), 403, "forbidden")
    assert "session=" in error["message"]
    assert_error(bob.get("/v1/deliveries", params={"session": session}), 404, "not_found")
    assert_error(bob.get(path), 404, "not_found")
    assert_error(bob.post(f"{path}/retry"), 403, "forbidden")
    assert [d["id"] for d in deliveries(alice, session=session)] == [row["id"]]
    assert alice.get(path).json() == row

    granted = alice.put(
        f"/v1/sessions/{session}/acl", json={"principal": "bob", "permission": "read"}
    )
    assert granted.status_code == 200, granted.text
    assert [d["id"] for d in deliveries(bob, session=session)] == [row["id"]]
    assert bob.get(path).json() == row
    assert_error(bob.get("/v1/deliveries"), 403, "forbidden")  # still not every delivery
    assert_error(bob.post(f"{path}/retry"), 403, "forbidden")
    with api.store() as store:
        assert store.deliveries.get(row["id"]).status == "dead"  # type: ignore[union-attr]

    error = assert_error(admin.get("/v1/deliveries", params={"status": "lost"}), 422, "invalid")
    assert error["field"] == "status"
    assert all(s in error["message"] for s in ("'lost'", "pending", "delivered", "dead"))
    error = assert_error(admin.get("/v1/deliveries", params={"session": "x"}), 422, "invalid")
    assert error["field"] == "session"
    assert_error(admin.get("/v1/deliveries", params={"session": UNKNOWN_SESSION}), 404)
    assert_error(admin.get("/v1/deliveries", params={"limit": "0"}), 422, "invalid")
    assert_error(admin.get(f"/v1/deliveries/{UNKNOWN_DELIVERY}"), 404, "not_found")


def test_the_daemon_refuses_to_start_when_a_targets_secret_is_unset(
    daemons: Callable[..., Daemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    daemon = daemons(delivery=delivery_config(free_port()))
    daemon.start(wait=False)
    assert daemon.wait(30) == 78
    lines = [line for line in daemon.log().splitlines() if line and not line.startswith("---")]
    assert len(lines) == 1, lines
    assert "delivery.targets.bridge.secret_env" in lines[0] and SECRET_ENV in lines[0]
    assert "s3cret" not in daemon.log()
