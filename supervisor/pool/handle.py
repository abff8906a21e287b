"""The supervisor's view of one worker process: what the pool, the control plane and
ownership know of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from supervisor.core import engine
from supervisor.core.engine import HEARTBEATS_MISSED
from supervisor.core.slots import Slot


@dataclass(eq=False)
class WorkerHandle:
    """The supervisor's view of one worker process."""

    slot: Slot
    identity: str  # w<slot>.<generation>: its name in logs, status and lease owners
    process: Any  # multiprocess.Process
    spare: bool
    started: float
    route: bytes = field(default=b"", repr=False)  # its routing identity (plane.py)
    secret: str = field(default="", repr=False)  # what its hello must carry
    hello: bool = False  # said a valid hello: its messages are read from now on
    ready: bool = False
    last_heartbeat: float = 0.0
    sessions: set[str] = field(default_factory=set)
    turns: int = 0  # in flight, as its last heartbeat said
    turns_served: int = 0  # ended since it started, as its last heartbeat said
    draining: bool = False  # its last heartbeat said it drains: it starts no turn
    retiring: bool = False  # replaced by a rolling restart; exits on request
    stop_requested: bool = False
    aborted_at: float | None = None
    suspected_at: float | None = None  # when its silence was first seen past the limit
    child_row: int | None = None
    mcp: dict[str, str] = field(default_factory=dict)  # its MCP servers' states by name
    model_down_since: float | None = None  # the model has not answered it since, if so
    replacing: bool = False  # sent a malformed message: killed, its frames ignored
    exited: bool = False  # its sentinel fired: gone, whether reaped yet or not
    # It beats at the interval it was started with (a reload may have changed the key
    # since); its silences are judged by that, and by the hang timeout that goes with it.
    heartbeat_interval: float = 1.0
    hang_timeout: float = 5.0

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    @property
    def alive(self) -> bool:
        return not self.exited and self.process.exitcode is None

    def view(self, interval: float | None = None) -> engine.WorkerView:
        """What the ownership engine reads of it.

        The engine judges every worker's heartbeats by one interval (`interval`, the one in
        force); a worker started with another is judged by its own: its last heartbeat is
        shown moved by the difference, which only the freshness rule reads.
        """
        moved = (
            0.0 if interval is None else HEARTBEATS_MISSED * (self.heartbeat_interval - interval)
        )
        return engine.WorkerView(
            name=self.identity,
            ready=self.ready,
            alive=self.alive,
            spare=self.spare,
            sessions=len(self.sessions),
            last_heartbeat=self.last_heartbeat + moved,
            retiring=self.retiring,
            stop_requested=self.stop_requested,
            aborted=self.aborted_at is not None,
            replacing=self.replacing,
        )
