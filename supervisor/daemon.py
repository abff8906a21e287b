"""`turnkeeper run`: the supervisor process.

The main loop reads like a story: write the boot row, migrate, serve until a signal,
stop, end the boot row. Signal handlers only enqueue; all work happens in the loop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from supervisor import __version__
from supervisor.config import Config, make_private_dir, resolve_paths
from supervisor.logs import log
from supervisor.store import Store

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Daemon:
    """One boot of the supervisor."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.paths = resolve_paths(config)
        self.store: Store | None = None
        self.boot_id: str | None = None
        self._stop = asyncio.Event()

    async def run(self) -> int:
        """Start, serve until SIGTERM or SIGINT, stop; returns the exit code."""
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self._on_stop_signal, signum)
        make_private_dir(self.paths.state_dir)
        make_private_dir(self.paths.runtime_dir)
        self.store = store = await asyncio.to_thread(
            Store, self.paths.db_url, self.config.store.synchronous
        )
        try:
            self.boot_id = await asyncio.to_thread(
                store.boots.begin, socket.gethostname(), os.getpid(), __version__
            )
            log("daemon").info(
                "ready: boot {} pid {} database {} (schema {})",
                self.boot_id,
                os.getpid(),
                store.backend,
                store.schema_version,
            )
            await self._stop.wait()
            log("shutdown").info("stopping")
            await asyncio.to_thread(store.boots.end, self.boot_id, "clean")
            log("shutdown").info("stopped cleanly")
            return 0
        finally:
            store.close()

    def _on_stop_signal(self, signum: int) -> None:
        if not self._stop.is_set():
            log("shutdown").info("received {}", signal.Signals(signum).name)
        self._stop.set()
