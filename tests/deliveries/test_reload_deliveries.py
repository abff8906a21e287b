"""A reload's changes to the deliveries, on a real store: a target whose events changed
has its sessions synced again, and the HTTP client of a changed target is closed only
once the attempt it carries ended (an idle one at once, without the reload waiting)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from supervisor.contract.config import Config
from supervisor.contract.delivery_targets import DeliveryTarget
from supervisor.deliveries.poster import Poster
from supervisor.deliveries.service import Courier
from supervisor.metrics import Metrics
from supervisor.store import Store

HOOK = {"name": "hook", "url": "http://hook.test/in", "secret_env": "TK_TEST_RELOAD_SECRET"}


def test_a_changed_target_s_client_is_closed_once_its_attempt_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TK_TEST_RELOAD_SECRET", "s")

    async def scenario() -> None:
        opened, gate = asyncio.Event(), asyncio.Event()

        async def answer(request: httpx.Request) -> httpx.Response:
            opened.set()
            await gate.wait()
            return httpx.Response(200)

        poster = Poster(httpx.MockTransport(answer))
        target = DeliveryTarget.model_validate(HOOK)
        first = asyncio.create_task(poster.post(target, 4, "d1", b"{}"))
        await opened.wait()
        (old,) = poster._clients.values()
        poster.retire(["hook"])
        assert not poster._clients and not old.is_closed  # its attempt goes on
        gate.set()
        second = await poster.post(target, 4, "d2", b"{}")  # a client of its own
        assert await first == (200, "") and second == (200, "")
        assert old.is_closed and not next(iter(poster._clients.values())).is_closed
        (idle,) = poster._clients.values()
        poster.retire(["hook"])  # nothing in flight: closed in the background, at once
        await asyncio.sleep(0)
        assert idle.is_closed and not poster._clients
        await poster.aclose()

    asyncio.run(scenario())


def test_sessions_get_what_their_target_sends_after_a_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TK_TEST_RELOAD_SECRET", "s")
    both = Config.model_validate({"delivery": {"targets": [HOOK]}})
    notices = Config.model_validate({"delivery": {"targets": [HOOK | {"events": ["notice"]}]}})

    async def scenario(store: Store, session_id: str) -> None:
        courier = Courier(both, store, "host/boot0001", Metrics(), transport=httpx.MockTransport(
            lambda request: httpx.Response(200)
        ))  # fmt: skip
        await courier._pass()
        assert kinds(store, session_id) == "answer notice"
        courier.reconfigure(notices)
        await courier._pass()
        assert kinds(store, session_id) == "notice"
        await courier.poster.aclose()

    with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
        session_id = store.sessions.create("alice").id
        store.deliveries.bind(session_id, "hook", ["answer", "notice"])
        asyncio.run(scenario(store, session_id))


def kinds(store: Store, session_id: str) -> str:
    cursor = store.db.execute_sql("SELECT deliver_kinds FROM session WHERE id = ?", (session_id,))
    return str(cursor.fetchone()[0])
