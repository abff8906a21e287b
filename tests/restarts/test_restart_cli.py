"""`turnkeeper restart` and `turnkeeper restarts` as a user runs them, against the real API
served in this process on a unix socket (a thread of its own) with a fake desk that writes
real rows: the test plays the daemon's part, boot by boot, while the command waits.

The daemon's own restart (the stop, the re-exec, the settlement) is
tests/restarts/test_restart_daemon.py's; here each of its phases is set by hand, and the command
must ride them out: the old boot stopping, a connection closed unanswered, nothing
listening, the new boot starting, the request settled.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import tomli_w
from aiohttp import web

from supervisor.contract.config import Config
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens, digest
from supervisor.metrics import Metrics
from supervisor.restarts.routes import RestartOut, RestartRefused
from supervisor.store import Me, Store
from supervisor.store.models import RestartRequest
from tests.daemon import cli_env, wait_until
from tests.restarts.test_restart_api import BOOT, HOST, NEXT_BOOT, PID, Desk
from tests.support import start_turnkeeper

T = TypeVar("T")
CONFIG_AFTER = "0123456789ab"


class Served:
    """The API of one boot at a time on `socket` (`up`, `down`); in between nothing
    listens. `statuses` counts the GET /v1/status answered, over every boot."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = root / "api.sock"
        self.store = Store(f"sqlite:///{root / 'db.sqlite'}")
        self.store.boots.begin(HOST, PID, "0.9.0", boot_id=BOOT)
        self.desk = Desk(self.store)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.api: Api | None = None
        self.runner: web.AppRunner | None = None
        self.statuses = 0
        self.config = root / "turnkeeper.toml"
        self.config.write_text(tomli_w.dumps({
            "daemon": {"state_dir": str(root / "state"), "runtime_dir": str(root / "run")},
            "http": {"listen": f"unix:{self.socket}"},
            "shutdown": {"drain_budget": 7.0},
        }))  # fmt: skip

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(30)

    def up(self, boot: str, *, ready: bool = True, pid: int = PID) -> Api:
        """Boot `boot` answers: its host row says `pid`."""
        me = Me(HOST, boot, "here", "machine", pid, 0.0, "0.9.0")
        self.store.hosts.register(me, 60.0, lambda _: True)
        tokens = Tokens({p: digest(f"{p}-token") for p in ("admin", "alice")})
        api = Api(Config(), self.store, Hub(), tokens, Metrics(), boot_id=boot, host_id=HOST)
        api.ready, api.restarts = ready, self.desk

        async def counted(request: web.Request, response: web.StreamResponse) -> None:
            if request.path == "/v1/status":
                self.statuses += 1

        async def start() -> web.AppRunner:
            app = api.app()
            app.on_response_prepare.append(counted)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.UnixSite(runner, str(self.socket)).start()
            return runner

        self.runner, self.api = self.run(start()), api
        return api

    def down(self) -> None:
        if self.runner is not None:
            self.run(self.runner.cleanup())
            self.runner = self.api = None

    def looked(self, what: str) -> None:
        """Wait until the command has read the status once more (it is waiting)."""
        seen = self.statuses
        wait_until(lambda: self.statuses > seen, 30, what)

    def unanswered(self, connections: int) -> None:
        """Between boots: a listener that closes each connection unanswered, until the
        command has tried it `connections` times; then nothing listens."""
        self.socket.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(self.socket))
            listener.listen()
            listener.settimeout(30)
            for _ in range(connections):
                listener.accept()[0].close()

    def close(self) -> None:
        self.down()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.store.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    daemon = Served(tmp_path)
    yield daemon
    daemon.close()


def start(served: Served, *args: str, token: str = "admin-token") -> subprocess.Popen[str]:
    env = cli_env(TURNKEEPER_TOKEN=token, COLUMNS="200")
    return start_turnkeeper(*args, config=served.config, env=env)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def turnkeeper(served: Served, *args: str, **kwargs: Any) -> tuple[int, str, str]:
    return finish(start(served, *args, **kwargs))


def asked(served: Served) -> str:
    """The id of the request the command made, once the desk has it."""
    # The desk records the call before its row is committed: wait for the row.
    live = wait_until(lambda: served.store.restarts.active(HOST), 30, "the restart request")
    assert served.desk.calls
    return str(live.id)


def test_restart_rides_out_the_restart_and_says_how_it_went(served: Served) -> None:
    served.up(BOOT)
    proc = start(served, "restart", "--drain", "--reason", "new model")
    made = asked(served)
    assert served.desk.calls == [("admin", "new model", None)]  # bare: restart.drain_budget
    served.looked("the command to wait on the pending request")
    served.store.restarts.begin(made, boot=BOOT, version="0.9.0", config="ab12cd34ef56")
    assert served.api is not None
    served.api.stopping = True
    served.looked("the command to see the old boot stopping")
    served.down()
    served.store.boots.end(BOOT, "clean")
    served.unanswered(2)
    time.sleep(0.5)  # nothing listens: the command's looks are refused (it looks every 0.2 s)
    served.up(NEXT_BOOT, ready=False)
    served.looked("the command to see the new boot starting")
    assert proc.poll() is None  # it still waits: the new boot is not ready
    served.store.restarts.settle(made, boot=NEXT_BOOT, version="0.9.1", config=CONFIG_AFTER)
    assert served.api is not None
    served.api.ready = True

    code, out, err = finish(proc)
    assert code == 0, err
    first, took, outcome, versions = out.splitlines()
    assert first == f"restart requested ({made})"
    settled = served.store.restarts.get(made)
    assert settled is not None and settled.seconds is not None
    ready = re.fullmatch(
        rf"restarted, ready (\d+\.\d) s after the request \(stopped and started in "
        rf"{settled.seconds:.1f} s\): boot {BOOT} -> {NEXT_BOOT}, "
        rf"pid {PID} \(the same process: re-executed in place\)",
        took,
    )
    assert ready, took
    # The new boot was held starting after the request was settled: it was ready later.
    assert float(ready[1]) >= float(f"{settled.seconds:.1f}")
    assert outcome == "outcome: ok"
    assert versions == f"version 0.9.0 -> 0.9.1, configuration ab12cd34ef56 -> {CONFIG_AFTER}"


def test_restart_json_of_a_restart_that_failed_in_a_new_process(served: Served) -> None:
    served.up(BOOT)
    proc = start(served, "restart", "--drain=2.5", "--json")
    made = asked(served)
    assert served.desk.calls == [("admin", "", 2.5)]
    served.looked("the command to wait")
    served.down()  # the old boot never ends in the boot log: it crashed
    served.up(NEXT_BOOT, pid=PID + 1)
    served.store.restarts.settle(made, boot=NEXT_BOOT, version="0.9.0", config=CONFIG_AFTER)

    code, out, err = finish(proc)
    assert code == 1, err
    document = json.loads(out)
    settled = served.store.restarts.get(made)
    assert settled is not None
    assert document["restart"] == RestartOut.model_validate(settled.as_dict()).model_dump(
        mode="json"
    )
    assert (document["done"], document["in_progress"]) == (True, False)
    assert (document["pid"], document["same_process"]) == (PID + 1, False)
    assert document["ready_after"] > 0
    assert document["restart"]["outcome"] == "failed"
    assert "did not stop cleanly" in document["restart"]["detail"]
    assert err == ""


def test_a_restart_refused_when_it_begins_is_reported_as_not_restarted(served: Served) -> None:
    served.up(BOOT)
    proc = start(served, "restart")
    made = asked(served)
    assert served.desk.calls == [("admin", "", None)]  # no --drain: the daemon's default
    served.looked("the command to wait")
    why = "the configuration does not load, so the daemon would not come back: bad"
    served.store.restarts.settle(
        made, boot=BOOT, version="0.9.0", config="ab12cd34ef56", refused=why
    )

    code, out, _ = finish(proc)
    assert code == 1
    assert out.splitlines()[1:3] == [
        f"not restarted: boot {BOOT} still runs (pid {PID})",
        f"outcome: failed (the restart did not happen: {why})",
    ]


def test_a_restart_in_progress_answers_and_no_wait_returns_at_once(served: Served) -> None:
    served.up(BOOT)
    live = served.desk.write("alice", "hot fix", None, HOST).info
    code, out, err = turnkeeper(served, "restart", "--no-wait", "--reason", "mine")
    assert code == 0, err
    assert out == f"a restart is already in progress ({live.id}, asked by alice: hot fix)\n"
    code, out, err = turnkeeper(served, "restart", "--no-wait", "--json")
    assert code == 0, err
    document = json.loads(out)
    assert (document["in_progress"], document["done"]) == (True, False)
    assert document["restart"]["id"] == live.id
    assert [call[1] for call in served.desk.calls] == ["mine", ""]


def test_restart_refusals_and_a_timeout(served: Served) -> None:
    code, _, err = turnkeeper(served, "restart")
    assert code == 3 and "not running" in err, err  # nothing listens at all

    served.up(BOOT)
    code, _, err = turnkeeper(served, "restart", "--drain=4000")
    assert code == 2 and "--drain" in err
    code, _, err = turnkeeper(served, "restart", token="alice-token")
    assert code == 1 and "only the admin principal may restart the daemon (HTTP 403)" in err

    served.desk.raises = RestartRefused("the daemon is stopping; start it again instead")
    code, _, err = turnkeeper(served, "restart")
    assert (code, err) == (1, "turnkeeper: the daemon is stopping; start it again instead "
                              "(HTTP 409)\n")  # fmt: skip
    served.desk.raises = None

    made = served.desk.write("admin", "", None, HOST).info.id
    served.store.restarts.settle(made, boot=NEXT_BOOT, version="0.9.0", config=CONFIG_AFTER)
    code, _, err = turnkeeper(served, "restart")
    assert code == 1 and "restart.min_interval is 60 s: try again in" in err and "429" in err

    with served.store.db.atomic():  # long ago: the next is not too soon
        RestartRequest.update(requested_at=RestartRequest.requested_at - 600).execute()
    code, out, err = turnkeeper(served, "restart", "--drain", "0", "--timeout", "1")
    assert code == 1
    pending = served.store.restarts.active(HOST)
    assert pending is not None and out == f"restart requested ({pending.id})\n"
    assert err == (
        f"turnkeeper: restart {pending.id} has not finished after 1 s (boot {BOOT} is ready, "
        "the request still pending); see `turnkeeper restarts` and the daemon's log\n"
    )


def test_restarts_lists_the_requests(served: Served) -> None:
    served.up(BOOT)
    code, out, _ = turnkeeper(served, "restarts")
    assert (code, out) == (0, "no restart requests of this host\n")
    older = served.desk.write("admin", "first " * 30, None, HOST).info
    served.store.boots.end(BOOT, "clean")
    served.store.restarts.begin(older.id, boot=BOOT, version="0.9.0", config="ab12cd34ef56")
    served.store.restarts.settle(older.id, boot=NEXT_BOOT, version="0.9.0", config=CONFIG_AFTER)
    elsewhere = served.desk.write("ops", "", 1.0, "other-host").info
    with served.store.db.atomic():
        RestartRequest.update(requested_at=RestartRequest.requested_at - 600).execute()
    newer = served.desk.write("admin", "second", 3.0, HOST).info

    code, out, err = turnkeeper(served, "restarts")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["ID", "STATE", "OUTCOME", "BY", "SESSION", "REQUESTED", "SECONDS",
                              "REASON"]  # fmt: skip
    assert [row.split()[:5] for row in rows] == [
        [newer.id, "pending", "-", "admin", "-"],
        [older.id, "done", "ok", "admin", "-"],
    ]
    assert rows[0].split()[-2:] == ["-", "second"]
    settled = served.store.restarts.get(older.id)
    assert settled is not None and settled.seconds is not None
    assert rows[1].split()[7] == f"{settled.seconds:.1f}"
    # The reason fills the rest of the terminal's 200 columns, cut with an ellipsis.
    assert len(rows[1]) == 200 and rows[1].endswith("first…")

    code, out, _ = turnkeeper(served, "restarts", "--all", "--limit", "2")
    header, *rows = out.splitlines()
    assert header.split()[-2:] == ["HOST", "REASON"]
    assert [row.split()[0] for row in rows] == [newer.id, elsewhere.id]
    assert rows[1].split()[-2:] == ["other-host", "-"]

    code, out, _ = turnkeeper(served, "restarts", "--json")
    listed = json.loads(out)["restarts"]
    assert [r["id"] for r in listed] == [newer.id, older.id]
    assert listed[1]["outcome"] == "ok" and listed[1]["boot_after"] == NEXT_BOOT
