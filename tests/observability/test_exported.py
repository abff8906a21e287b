"""Against a real daemon: every metric a dashboard panel or an alert rule names is in its
`/metrics`, and the figures added for the alerts move with what they report: the
database taking writes, the state directory's free space, the model's failed calls."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.daemon import Daemon, LoopbackServer, answer_json, daemons, turn_ended, wait_until
from tests.observability.promql import missing, value
from tests.observability.shipped import dashboard, dashboard_queries, rules
from tests.security.test_storage import BIG, _fill, small_disk

__all__ = ["daemons", "small_disk"]

Daemons = Callable[..., Daemon]


def test_every_metric_of_the_dashboard_and_the_rules_is_exported(daemons: Daemons) -> None:
    daemon = daemons().start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        session = api.post("/v1/sessions", json={"title": "metrics"}).json()["id"]
        api.post(f"/v1/sessions/{session}/inject", json={"text": "hello"}).raise_for_status()
        wait_until(lambda: turn_ended(store, session), 30, "the turn")
        # The workers' figures come with their heartbeats: wait for the turn's tokens.
        tokens = lambda: value(  # noqa: E731
            api.get("/metrics").text, "turnkeeper_model_tokens_total", kind="completion"
        )
        wait_until(tokens, 30, "the turn's tokens in /metrics")
        exposition = api.get("/metrics").text
    queries = dashboard_queries(dashboard()) + [r["expr"] for r in rules()]
    assert missing(queries, exposition) == {}
    # The figures the alerts read, each with a sample on a healthy daemon.
    assert value(exposition, "turnkeeper_storage_up") == 1
    assert value(exposition, "turnkeeper_model_up") == 1
    assert value(exposition, "turnkeeper_breaker_tripped") == 0
    assert value(exposition, "turnkeeper_workers", state="running") == 2
    assert value(exposition, "turnkeeper_sessions", state="quarantined") == 0
    assert value(exposition, "turnkeeper_deliveries", status="dead") == 0
    assert value(exposition, "turnkeeper_hosts", state="lost") == 0
    assert value(exposition, "turnkeeper_model_errors_total", kind="transient") == 0
    disk = shutil.disk_usage(daemon.state)
    assert value(exposition, "turnkeeper_state_dir_size_bytes") == disk.total
    free = value(exposition, "turnkeeper_state_dir_free_bytes")
    assert free is not None and abs(free - disk.free) < 64 * 2**20  # other tests write too


def test_storage_up_and_free_space_follow_a_full_disk(
    daemons: Daemons, tmp_path: Path, small_disk: Path
) -> None:
    daemon = daemons(daemon={"state_dir": str(small_disk / "state")})
    daemon.state = small_disk / "state"
    daemon.url = f"sqlite:///{daemon.state / 'turnkeeper.db'}"
    daemon.start()
    with daemon.client() as api:
        metrics = lambda: api.get("/metrics").text  # noqa: E731
        assert value(metrics(), "turnkeeper_storage_up") == 1
        assert value(metrics(), "turnkeeper_state_dir_size_bytes") == 24 * 2**20
        session = api.post("/v1/sessions", json={}).json()["id"]
        filler = _fill(small_disk)
        assert value(metrics(), "turnkeeper_state_dir_free_bytes") == 0
        for _ in range(200):  # the log's free pages run out within a few megabytes
            answer = api.post(f"/v1/sessions/{session}/inject", json={"text": BIG})
            if answer.status_code != 202:
                break
        assert answer.status_code == 503, answer.text
        assert value(metrics(), "turnkeeper_storage_up") == 0
        filler.unlink()
        assert value(metrics(), "turnkeeper_state_dir_free_bytes") > 2**20  # type: ignore[operator]
        wait_until(lambda: api.get("/readyz").status_code == 200, 30, "readiness again")
        assert value(metrics(), "turnkeeper_storage_up") == 1


class Failing(BaseHTTPRequestHandler):
    """A model server that answers 503 (transient) twice, then 400 (permanent) for good."""

    calls = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with Failing.lock:
            Failing.calls += 1
            status = 503 if Failing.calls <= 2 else 400
        answer_json(self, status, {"error": {"message": f"refused with {status}"}})

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def failing() -> Iterator[LoopbackServer]:
    Failing.calls = 0
    server = LoopbackServer(Failing)
    try:
        yield server
    finally:
        server.close()


def test_model_errors_are_counted_by_kind(daemons: Daemons, failing: LoopbackServer) -> None:
    model = {"provider": "openai", "base_url": failing.url("/v1"), "model": "m"}
    daemon = daemons(model=model).start()
    with daemon.client() as api, Store(daemon.url, migrate=False) as store:
        before = api.get("/metrics").text
        assert value(before, "turnkeeper_model_errors_total", kind="transient") == 0
        assert value(before, "turnkeeper_model_errors_total", kind="permanent") == 0
        session = api.post("/v1/sessions", json={"title": "errors"}).json()["id"]
        api.post(f"/v1/sessions/{session}/inject", json={"text": "hi"}).raise_for_status()
        ended = wait_until(lambda: turn_ended(store, session), 60, "the turn's end")
        assert ended.payload["outcome"] == "failed" and "400" in ended.payload["error"]

        def counted() -> tuple[float | None, float | None]:
            text = api.get("/metrics").text
            return (
                value(text, "turnkeeper_model_errors_total", kind="transient"),
                value(text, "turnkeeper_model_errors_total", kind="permanent"),
            )

        wait_until(lambda: counted() == (2, 1), 30, "2 transient and 1 permanent error")
        assert Failing.calls == 3
