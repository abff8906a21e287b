"""The first reads of the sessions an `assign` hands a worker, made for all of them at once.

A runner that starts reads its session row, then its log from the newest compaction on
(`SessionRunner._read_whole`). A dead worker's k sessions come to the spare in one
message; read runner by runner, that is 3k queries queued on the worker's few database
threads, and the first turn goes on only once most of them are done. A `Prefetch` reads
them for the batch instead, in one trip to a thread: the rows, each with its newest
compaction, in one query, and the logs in one more. Each runner takes its own once
(`first`); one that finds nothing there (its token moved on, or the read failed) reads
alone, as before. The read is as fresh as a runner's own: it starts after the assignment
arrived, and the row is read before the log.
"""

from __future__ import annotations

import asyncio

from loguru import logger

from supervisor.store import SessionInfo, Store
from workers.cache import SessionLog
from workers.context import Summary

First = tuple[SessionInfo, SessionLog]


class Prefetch:
    """The rows and logs of a batch of sessions, each for the lease token it was assigned
    with: sessions are added (`add`) until the batch is read (`start`)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._tokens: dict[str, int] = {}
        self._taken: set[str] = set()  # sessions whose runner had its part (or None)
        self._started = asyncio.Event()
        self._read: asyncio.Future[dict[str, First]] | None = None

    def add(self, session_id: str, token: int) -> None:
        """Read this session too, for a runner writing with `token`."""
        self._tokens[session_id] = token

    def start(self) -> None:
        """Read the batch (once); the runners waiting in `first` get their part."""
        if self._read is None:
            # Handed to a database thread now, not at a task's first step: ahead of the
            # runners' own first steps.
            loop = asyncio.get_running_loop()
            self._read = loop.run_in_executor(None, read_batch, self._store, dict(self._tokens))
            self._read.add_done_callback(_said)
            self._started.set()

    async def first(self, session_id: str, token: int) -> First | None:
        """The session's row and log as the batch read them, once; None when they are
        not there for `token` (the caller reads them itself)."""
        if session_id in self._taken or self._tokens.get(session_id) != token:
            return None
        self._taken.add(session_id)
        await self._started.wait()
        assert self._read is not None
        try:
            found = await asyncio.shield(self._read)
        except Exception:  # said once by `_said`; the runner's own read says the rest
            return None
        return found.pop(session_id, None)


def read_batch(store: Store, tokens: dict[str, int]) -> dict[str, First]:
    """Each session's row and its log from the newest compaction on (what
    `SessionRunner._read_whole` reads), under the token it was assigned with: two queries."""
    opened = store.sessions.opening(list(tokens))
    after: dict[str, int] = {}
    for session_id, (_, compaction) in opened.items():
        summary = None if compaction is None else Summary.of_payload(compaction)
        after[session_id] = 0 if summary is None else summary.to_seq
    logs = store.events.logs(after)
    return {sid: (info, SessionLog(logs[sid], tokens[sid])) for sid, (info, _) in opened.items()}


def _said(read: asyncio.Future[dict[str, First]]) -> None:
    if not read.cancelled() and read.exception() is not None:
        logger.bind(subsystem="worker").warning(
            "could not read the assigned sessions together ({}); each reads its own",
            read.exception(),
        )
