"""What the scale figures share: a daemon on a loopback port, its API, its database read
directly, and the shape of a judged figure.

A figure is a dict with its `checks`: each check names a value, its target and whether
the value meets it. A value that could not be measured (a timeout) is None and does not
meet its target.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from supervisor.contract.config import AgentConfig, PoolConfig, RecoveryConfig
from tests.benchmarks.figures import alive, free_port, log_time, shipped_pool, stop
from tests.daemon import Daemon

T = TypeVar("T")
POLL_S = 0.01  # database polls while a figure waits for an event
LOG_TAIL = 30  # lines of the daemon's log a failed figure reports
STREAMS = 1000  # http.max_streams_per_principal: every client here is the admin
SHIPPED_POOL = PoolConfig()
GATE_AGENT = "tests.agents:ChaosAgent"  # the shipped agent plus `/gate PATH T`
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ", re.MULTILINE)


# --- figures -----------------------------------------------------------------------


def check(name: str, value: float | None, op: str, limit: float, unit: str = "") -> dict[str, Any]:
    """One judged value: `op` is "<=" or ">="."""
    met = value is not None and (value <= limit if op == "<=" else value >= limit)
    shown = None if value is None else round(value, 3)
    return {"name": name, "value": shown, "target": f"{op} {limit}{unit}", "met": met}


def ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return round(value / baseline, 3)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def log_marks(log: str, pattern: str) -> list[tuple[float, re.Match[str]]]:
    """(time, match) of every log line whose text after the timestamp matches `pattern`."""
    found = []
    for line in log.splitlines():
        stamp = _STAMP.match(line)
        if stamp is None:
            continue
        match = re.search(pattern, line[stamp.end() :])
        if match is not None:
            found.append((log_time(stamp.group(1)), match))
    return found


async def poll(predicate: Callable[[], T], timeout: float, interval: float = POLL_S) -> T | None:
    """Await `predicate()` being truthy; its value, or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(interval)


# --- the daemon --------------------------------------------------------------------


class ScaleDaemon:
    """`turnkeeper run` on a free loopback port, with the shipped pool timings and
    recovery schedule unless a figure says otherwise."""

    def __init__(
        self,
        root: Path,
        *,
        workers: int = SHIPPED_POOL.workers,
        spare: int = SHIPPED_POOL.spare,
        agent: str = AgentConfig().class_,
        delay: float = 0.0,
        model: dict[str, Any] | None = None,
        recovery: dict[str, Any] | None = None,
    ) -> None:
        self.port = free_port()
        self.pool = shipped_pool(workers, spare)
        self.daemon = Daemon(
            root,
            http={"listen": f"127.0.0.1:{self.port}", "max_streams_per_principal": STREAMS},
            pool=self.pool,
            agent={"class": agent},
            model={"provider": "echo", "delay": delay, **(model or {})},
            recovery={"attempt_delays": list(RecoveryConfig().attempt_delays), **(recovery or {})},
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self.token = ""
        self._db: sqlite3.Connection | None = None

    @property
    def db_path(self) -> Path:
        return self.daemon.state / "turnkeeper.db"

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def pid(self) -> int:
        return self.daemon.pid

    def start(self) -> float:
        """Start and wait until ready; seconds it took."""
        started = time.monotonic()
        STARTED.append(self)
        self.daemon.start()
        self.token = (self.daemon.state / "admin.token").read_text().strip()
        return round(time.monotonic() - started, 2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL whatever is left, by pid."""
        try:
            if self._db is not None:
                self._db.close()
                self._db = None
        finally:
            if self.daemon.proc is not None:
                stop(self.daemon)

    def run_log(self) -> str:
        """The daemon's log of its latest run."""
        return self.daemon.log().rsplit(f"--- run {self.daemon.runs} ---", 1)[-1]

    # --- the database, read directly ------------------------------------------------

    def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self._db is None:
            # Read from the event loop, closed by `stop` in another thread.
            self._db = sqlite3.connect(
                f"file:{self.db_path}?mode=ro", uri=True, timeout=30, check_same_thread=False
            )
        return self._db.execute(query, params).fetchall()

    def event_after(self, session_id: str, seq: int, types: tuple[str, ...]) -> Any:
        """(seq, type, created_at, lease_token) of the first event of `types` after `seq`."""
        marks = ",".join("?" * len(types))
        rows = self.sql(
            f"SELECT seq, type, created_at, lease_token FROM event WHERE session_id = ? "
            f"AND seq > ? AND type IN ({marks}) ORDER BY seq LIMIT 1",
            (session_id, seq, *types),
        )
        return rows[0] if rows else None

    def owners(self, session_ids: list[str]) -> dict[str, str | None]:
        """Each session's lease owner's worker identity (`w1.2`), or None."""
        found: dict[str, str | None] = {}
        for start in range(0, len(session_ids), 500):
            chunk = session_ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for sid, owner in self.sql(
                f"SELECT id, owner FROM session WHERE id IN ({marks})", tuple(chunk)
            ):
                found[sid] = owner.rsplit("/", 1)[-1] if owner else None
        return found

    def worker_pids(self) -> dict[str, int]:
        """The workers in the pool's slots now, by identity."""
        return self.daemon.worker_pids()

    def full_strength(self) -> bool:
        """Every slot has a ready, live worker."""
        slots = self.daemon.status()["slots"]
        want = self.pool["workers"] + self.pool["spare"]
        ready = [s for s in slots if s["worker"] and s["pid"] and s["ready"]]
        return len(ready) == want and all(alive(int(s["pid"])) for s in ready)

    # --- the API --------------------------------------------------------------------

    def client(self, timeout: float = 60.0) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        )

    async def create(self, http: aiohttp.ClientSession, count: int) -> list[str]:
        """`count` new sessions, created concurrently."""

        async def one(i: int) -> str:
            async with http.post(f"{self.base}/v1/sessions", json={"title": f"scale {i}"}) as r:
                body = await r.json()
                if r.status != 201:
                    raise RuntimeError(f"POST /v1/sessions answered {r.status}: {body}")
                return str(body["id"])

        return list(await asyncio.gather(*(one(i) for i in range(count))))

    async def inject(self, http: aiohttp.ClientSession, session_id: str, text: str) -> int:
        """Inject over HTTP; the seq once the 202 came."""
        url = f"{self.base}/v1/sessions/{session_id}/inject"
        async with http.post(url, json={"text": text}) as r:
            body = await r.json()
            if r.status != 202:
                raise RuntimeError(f"inject answered {r.status}: {body}")
            return int(body["seq"])

    async def close_sessions(self, http: aiohttp.ClientSession, session_ids: list[str]) -> None:
        async def one(sid: str) -> None:
            async with http.delete(f"{self.base}/v1/sessions/{sid}") as r:
                await r.read()

        await asyncio.gather(*(one(s) for s in session_ids))

    async def turn(
        self, http: aiohttp.ClientSession, session_id: str, text: str, timeout: float = 60.0
    ) -> dict[str, float | None]:
        """Inject and wait for the turn's end. Seconds from just before the request to its
        202, and to the `created_at` of the `model_response` and `turn_ended` (stamped by
        the worker just before its commit, on this host's clock: no polling delay)."""
        sent = time.time()
        seq = await self.inject(http, session_id, text)
        answered = time.time()
        ended = await poll(
            lambda: self.event_after(session_id, seq, ("turn_ended",)), timeout, POLL_S
        )
        reply = self.event_after(session_id, seq, ("model_response",))
        return {
            "request_s": answered - sent,
            "reply_s": None if reply is None else reply[2] - sent,
            "turn_ended_s": None if ended is None else ended[2] - sent,
        }


STARTED: list[ScaleDaemon] = []  # every daemon started, for `stop_all`


def stop_all() -> None:
    """Stop every daemon started here that is still running (our child, not yet reaped:
    its pid cannot have been reused)."""
    for daemon in STARTED:
        if daemon.daemon.proc is not None and daemon.daemon.proc.poll() is None:
            daemon.stop()
    STARTED.clear()


async def with_daemon(
    daemon: ScaleDaemon, body: Callable[[ScaleDaemon], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """Start `daemon`, run `body` with it, always stop it; body's figures with the
    seconds the start took, `daemon_start_s`."""
    try:
        started = await asyncio.to_thread(daemon.start)
        return await body(daemon) | {"daemon_start_s": started}
    except BaseException as exc:
        with contextlib.suppress(OSError):
            exc.add_note("\n".join(daemon.run_log().splitlines()[-LOG_TAIL:]))
        raise
    finally:
        await asyncio.to_thread(daemon.stop)
