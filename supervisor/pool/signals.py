"""Wakes across daemons: input committed on one host reaches the owner on another at once.

On PostgreSQL a daemon that commits input for a session it does not run sends
`NOTIFY turnkeeper_wake, '<session id>'`; every daemon LISTENs on a connection of its own
(in a thread, so the event loop never blocks on it) and wakes the session's worker if it
runs the session. A notification is only a hint, safe to lose or to get twice: the owner
re-reads the database, and every pool's short probe of pending sessions (MariaDB's only
way, and the fallback here) finds the input anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import select
import threading
from collections.abc import Callable
from typing import Any

from supervisor.contract.logs import log
from supervisor.runtime.service import Service, Steps
from supervisor.store import Store
from supervisor.teardown import WAKE_LISTENER

CHANNEL = "turnkeeper_wake"
RECONNECT = 2.0  # seconds between attempts to listen again after the connection broke
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def channel_of(params: dict[str, Any]) -> str:
    """The channel: one per database, and per schema when the URL picks one (`options`),
    since NOTIFY reaches every session of the database whatever its search_path."""
    options = str(params.get("options") or "")
    if not options:
        return CHANNEL
    return f"{CHANNEL}_{hashlib.blake2b(options.encode(), digest_size=6).hexdigest()}"


class Signals(Service):
    """The wake channel of one daemon: `announce` sends, a thread listens."""

    name = "signals"
    needs = ("store",)

    def __init__(self, store: Store, on_wake: Callable[[str], object]) -> None:
        self.store = store
        self.on_wake = on_wake
        self.enabled = store.backend == "postgresql"
        self.channel = channel_of(getattr(store.db, "connect_params", {}))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.log = log("pool")

    async def start(self) -> None:
        """Listen (PostgreSQL only) from now on; wakes are handed to the running loop."""
        if not self.enabled:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._listen, name="wake-listener", daemon=True)
        self._thread.start()

    async def stop(self, steps: Steps | None = None) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WAKE_LISTENER)

    def announce(self, session_id: str) -> None:
        """Tell the other daemons that the session has new input (blocking: a thread)."""
        if self.enabled:
            self.store.db.execute_sql("SELECT pg_notify(%s, %s)", (self.channel, session_id))

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen_once()
            except Exception as exc:  # the server restarted, the network broke
                self.log.warning("wake channel: {}; listening again in {:.0f} s", exc, RECONNECT)
            self._stop.wait(RECONNECT)

    def _listen_once(self) -> None:
        import psycopg2

        db: Any = self.store.db
        conn: Any = psycopg2.connect(database=db.database, **db.connect_params)
        try:
            conn.autocommit = True
            conn.cursor().execute(f"LISTEN {self.channel}")
            # poll(), not select(): the daemon raises its descriptor limit, and this
            # connection's may be numbered above select()'s 1024 (many HTTP clients).
            readable = select.poll()
            readable.register(conn, select.POLLIN)
            while not self._stop.is_set():
                if not readable.poll(500):
                    continue
                conn.poll()
                while conn.notifies:
                    payload = conn.notifies.pop(0).payload
                    if _SESSION_ID.fullmatch(payload) and self._loop is not None:
                        self._loop.call_soon_threadsafe(self.on_wake, payload)
        finally:
            with contextlib.suppress(Exception):
                conn.close()
