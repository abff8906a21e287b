"""A reload applied to a daemon's parts, in this process, no worker started: a real pool
(ownership, recovery, the subagents' reconciler, the task keeper, the scheduler, the
courier), the API and its routes and the daemon, on a real SQLite store, with the read of
the configuration given by the test. Every part that holds a configuration holds the
new one after a reload; a failure anywhere is a refused reload that changes nothing; a
revoked token's attach streams are hung up, also one whose session was being read; a
SIGHUP's reload and an HTTP one run one after the other and both are answered; the
daemon's loop survives a reload that fails and notices a fatal pool while one runs; a
stop ends the reload under way and refuses those after it; a reload's agent check reaps
its own child."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel

from supervisor.composition import Hooks, build
from supervisor.contract.config import Config
from supervisor.daemon import Daemon
from supervisor.http.auth import Tokens, digest
from supervisor.http.reload_route import STARTED
from supervisor.reloading import STOPPED, STOPPING, Reloader
from supervisor.runtime.bus import Stopping
from supervisor.store import Store

BOOT = "b" * 32
ADMIN = {"Authorization": "Bearer admin-token"}
TOKENS = {"admin": digest("admin-token"), "alice": digest("alice-token")}
Scenario = Callable[[Daemon, Reloader, TestClient], Awaitable[None]]
Slots = Collection[int] | None


def configured(tmp_path: Path, **sections: dict[str, Any]) -> Config:
    base: dict[str, Any] = {
        "daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")},
        "pool": {"workers": 1, "spare": 0},  # the slot has no worker: none is started
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return Config.model_validate(base)


def serve(tmp_path: Path, scenario: Scenario) -> None:
    """Run `scenario` with a daemon's parts, its reloader and a client of its API."""

    async def run() -> None:
        config = configured(tmp_path)
        with Store(f"sqlite:///{tmp_path / 'turnkeeper.db'}") as store:
            daemon = Daemon(config)
            hooks = Hooks(lambda: None, lambda _: None, lambda: False, daemon._configured)
            tree = build(
                config,
                None,
                store,
                Tokens(TOKENS),
                hooks,
                boot_id=BOOT,
                host="host",
                runtime_dir=tmp_path / "run",
                state_dir=tmp_path / "state",
            )  # the composition root's tree, not started: no worker, no listener
            daemon.tree, daemon.bus, daemon.api = tree, tree.bus, tree.api
            reloader = daemon.reloader = tree.reloader
            tree.api.ready = True
            async with TestClient(TestServer(tree.api.app())) as client:
                await scenario(daemon, reloader, client)

    asyncio.run(run())


def reads(reloader: Reloader, config: Config, tokens: dict[str, str] = TOKENS) -> list[int]:
    """The reloader reads `config` and `tokens` from now on; the list counts its reads."""
    count: list[int] = []

    def read() -> tuple[Config, Tokens]:
        count.append(reloader.pool.holding)  # the agent check's child is its own to reap
        return config, Tokens(tokens)

    reloader._read = read  # type: ignore[method-assign]
    return count


def reachable(root: object) -> Iterator[object]:
    """Every object reachable from `root` through the attributes of the project's own
    objects and through containers (a configuration's insides are not walked)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            todo += list(obj)
        elif isinstance(obj, BaseModel):
            continue
        elif type(obj).__module__.startswith(("supervisor.", "workers.")):
            todo += list(getattr(obj, "__dict__", {}).values())


def test_every_part_that_holds_a_configuration_holds_the_new_one(tmp_path: Path) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        old = reloader.config
        assert reloader.loaded_at == STARTED  # when `run` loaded it
        new = configured(
            tmp_path,
            schedules={"min_interval": 5.0},
            pool={"hang_timeout": 9.0},
            http={"max_streams_per_principal": 2, "listen": "127.0.0.1:1"},
        )
        reads(reloader, new)
        asked = time.time()
        result = await reloader.reload()
        assert result.ok and result.needs_restart == ["http.listen"], result
        assert asked <= reloader.loaded_at <= time.time()
        config = reloader.config
        assert config.schedules.min_interval == 5.0 and config.http.max_streams_per_principal == 2
        assert config.http.listen == old.http.listen  # left as it was
        stale = {id(old), *(id(getattr(old, name)) for name in Config.model_fields)}
        holders = [obj for obj in reachable(daemon) if isinstance(obj, Config)]
        assert holders and all(obj is config for obj in holders)
        assert not [obj for obj in reachable(daemon) if id(obj) in stale]
        pool, root = reloader.pool, daemon.tree.root  # type: ignore[union-attr]
        assert pool.config is pool.ownership.config is pool.recovery.config is config
        assert all(getattr(s, "config", config) is config for s in root.services)
        assert root["schedules"].config is root["courier"].config is daemon.config is config  # type: ignore[attr-defined]
        assert all(routes.config is config for routes in daemon.api.configured)  # type: ignore[union-attr]
        unchanged = await reloader.reload()
        assert unchanged.ok and unchanged.loaded_at == result.loaded_at

    serve(tmp_path, scenario)


def test_a_failure_anywhere_is_a_refused_reload_that_changes_nothing(tmp_path: Path) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        old, version = reloader.config, reloader.version

        def broken() -> tuple[Config, Tokens]:
            raise RuntimeError("disk on fire")

        reloader._read = broken  # type: ignore[method-assign]
        failed = await reloader.reload()
        assert not failed.ok and "RuntimeError('disk on fire')" in str(failed.error)
        reads(reloader, configured(tmp_path, schedules={"min_interval": 5.0}), {})
        api = daemon.api
        assert api is not None

        def refuse(config: Config) -> None:
            if config is not old:  # the old one is taken back
                raise ValueError("a part that cannot take it")

        api.reconfigure = refuse  # type: ignore[method-assign]  # the last part swapped
        answer = await client.post("/v1/reload", headers=ADMIN)
        assert answer.status == 500, await answer.text()  # the daemon's error, not the file's
        assert "ValueError" in (await answer.json())["error"]["message"]
        assert reloader.version == version and reloader.config is old and daemon.config is old
        schedules = daemon.tree.root["schedules"]  # type: ignore[union-attr]
        assert reloader.pool.config is old and schedules.config is old  # type: ignore[attr-defined]
        assert api.tokens.principals() == TOKENS  # the tokens with the rest: not taken
        del api.reconfigure  # the class's again
        reads(reloader, configured(tmp_path, schedules={"min_interval": 5.0}), {})

        def hang_up(principals: Any) -> int:  # the last step: after the version
            raise OSError("no")

        api.hub.hang_up = hang_up  # type: ignore[method-assign]
        late = await reloader.reload()
        assert not late.ok and "OSError" in str(late.error)
        assert reloader.version == version and reloader.config is old and api.config is old
        assert api.tokens.principals() == TOKENS

    serve(tmp_path, scenario)


def test_the_streams_of_a_revoked_or_replaced_token_are_hung_up(tmp_path: Path) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        assert daemon.api is not None
        hub = daemon.api.hub
        alice, admin = hub.subscribe("s" * 32, "alice"), hub.subscribe("s" * 32, "admin")
        reads(reloader, reloader.config, {"admin": TOKENS["admin"]})
        assert (await reloader.reload()).ok
        assert hub.streams_of("alice") == 0 and alice.dropped and alice.queue.qsize() == 1
        assert hub.streams_of("admin") == 1 and not admin.dropped

    serve(tmp_path, scenario)


def test_a_token_revoked_while_its_attach_reads_the_session_gets_no_stream(
    tmp_path: Path,
) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        api = daemon.api
        assert api is not None
        alice = {"Authorization": "Bearer alice-token"}
        made = await client.post("/v1/sessions", json={}, headers=alice)
        sid = (await made.json())["id"]
        read_session, entered, go = api._session, asyncio.Event(), asyncio.Event()

        async def held(request: Any, *args: Any) -> Any:  # the read the reload falls into
            info = await read_session(request, *args)
            entered.set()
            await go.wait()
            return info

        api._session = held  # type: ignore[method-assign]
        attaching = asyncio.ensure_future(client.get(f"/v1/sessions/{sid}/attach", headers=alice))
        await asyncio.wait_for(entered.wait(), 10)
        reads(reloader, reloader.config, {"admin": TOKENS["admin"]})
        assert (await reloader.reload()).ok
        go.set()
        answer = await asyncio.wait_for(attaching, 10)
        assert answer.status == 401, await answer.text()
        assert (await answer.json())["error"]["code"] == "unauthorized"
        assert api.hub.streams_of("alice") == 0

    serve(tmp_path, scenario)


def test_a_sighup_and_an_http_reload_run_one_after_the_other(tmp_path: Path) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        entered, gate, calls = threading.Event(), threading.Event(), []
        new = configured(tmp_path, schedules={"min_interval": 5.0})

        def read() -> tuple[Config, Tokens]:
            calls.append("in")
            entered.set()
            gate.wait(10)
            calls.append("out")
            return new, Tokens(TOKENS)

        reloader._read = read  # type: ignore[method-assign]
        reloader.begin()  # SIGHUP's
        assert await asyncio.to_thread(entered.wait, 10)
        posted = asyncio.ensure_future(client.post("/v1/reload", headers=ADMIN))
        await asyncio.sleep(0.2)
        assert calls == ["in"] and not posted.done()  # it waits for the first
        gate.set()
        answer = await asyncio.wait_for(posted, 10)
        assert answer.status == 200 and (await answer.json())["ok"]
        assert calls == ["in", "out", "in", "out"] and not reloader._running

    serve(tmp_path, scenario)


def test_the_daemon_s_loop_outlives_a_failed_reload_and_sees_a_fatal_pool(
    tmp_path: Path,
) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        pool, gate, entered = reloader.pool, threading.Event(), threading.Event()

        def broken() -> tuple[Config, Tokens]:
            entered.set()
            raise RuntimeError("a bug")

        reloader._read = broken  # type: ignore[method-assign]
        serving = asyncio.ensure_future(daemon._serve(pool))
        daemon._reloads.put_nowait(None)  # SIGHUP
        assert await asyncio.to_thread(entered.wait, 10)
        while reloader._running:
            await asyncio.sleep(0.01)
        assert not serving.done()  # the failure was logged, the loop goes on

        def stuck() -> tuple[Config, Tokens]:
            entered.set()
            gate.wait(10)
            return reloader.config, Tokens(TOKENS)

        entered.clear()
        reloader._read = stuck  # type: ignore[method-assign]
        daemon._reloads.put_nowait(None)
        try:
            assert await asyncio.to_thread(entered.wait, 10)
            pool.fatal.set()  # every slot gave up while the reload reads
            await asyncio.wait_for(serving, 5)
            assert reloader.closed and not reloader._running
        finally:
            gate.set()

    serve(tmp_path, scenario)


@pytest.mark.parametrize("restart", [False, True], ids=["SIGTERM", "a restart's drain"])
def test_a_stop_ends_the_reload_under_way_and_refuses_those_after(
    tmp_path: Path, restart: bool
) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        pool, shrinking, rolled = reloader.pool, asyncio.Event(), []
        count = reads(reloader, configured(tmp_path, schedules={"min_interval": 5.0}))

        async def shrink(timeout: float = 0.0) -> list[int]:
            shrinking.set()
            await asyncio.Event().wait()  # a slot whose sessions take long to hand over
            return []

        async def rolling_restart(timeout: float = 0.0, only: Slots = None) -> str | None:
            rolled.append(only)
            return None

        pool.shrink, pool.rolling_restart = shrink, rolling_restart  # type: ignore[method-assign]
        under_way = asyncio.ensure_future(reloader.reload(workers=True))
        await asyncio.wait_for(shrinking.wait(), 5)
        daemon._stopping_now(Stopping("stop requested", restart=restart))
        result = await asyncio.wait_for(under_way, 5)
        assert result.ok and result.incomplete == STOPPED and rolled == []
        after = await reloader.reload()
        assert not after.ok and after.error == STOPPING and len(count) == 1
        answer = await client.post("/v1/reload", headers=ADMIN)
        assert answer.status == 503

    serve(tmp_path, scenario)


def test_a_roll_that_stops_leaves_the_slots_that_gave_up_alone(tmp_path: Path) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        pool, revived = reloader.pool, []
        reads(reloader, reloader.config)

        async def shrink(timeout: float = 0.0) -> list[int]:
            return []

        async def rolling_restart(timeout: float = 0.0, only: Slots = None) -> str | None:
            return why

        def revive() -> list[int]:
            revived.append(True)
            return []

        pool.shrink, pool.rolling_restart, pool.revive = shrink, rolling_restart, revive  # type: ignore[method-assign]
        why: str | None = "worker w0.2, replacing w0.1, died before it was ready"
        stopped = await reloader.reload(workers=True)
        assert stopped.incomplete == why and not stopped.workers_replaced and revived == []
        why = None
        done = await reloader.reload(workers=True)
        assert done.incomplete is None and done.workers_replaced and revived == [True]

    serve(tmp_path, scenario)


def test_a_child_someone_else_waits_for_is_not_reaped_during_a_read(tmp_path: Path) -> None:
    async def scenario(daemon: Daemon, reloader: Reloader, client: TestClient) -> None:
        pool = reloader.pool
        count = reads(reloader, reloader.config)
        assert (await reloader.reload()).ok and count == [1]  # read with orphans held
        child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        with pool.orphans_held():
            while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
                await asyncio.sleep(0.01)
            pool._on_child_exit()  # SIGCHLD meanwhile
            assert child.wait(5) == 3  # its status is still its waiter's

    serve(tmp_path, scenario)
