"""The control plane: the ROUTER socket the workers talk to, and whom it listens to.

It trusts only what it handed out (see contract/control.py): a frame from a routing
identity no worker was spawned with is dropped, and logged once per peer; a worker is read
only after a hello with its spawn's secret; a message that does not fit its schema gets
the worker that sent it replaced. Nothing a peer sends can end the receive loop.

A service of its own (docs/architecture.md): bound before the pool starts its first
worker, closed after the pool stopped every one. What a worker says is published on the
bus (`Said`), and so is a worker to replace (`Misbehaved`): the pool hears both.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import zmq
import zmq.asyncio

from supervisor.contract import control
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.logs import log
from supervisor.pool.handle import WorkerHandle
from supervisor.runtime.bus import Bus
from supervisor.runtime.service import Service, Steps


@dataclass(frozen=True)
class Said:
    """A worker that said its hello sent a message that fits its schema."""

    worker: WorkerHandle
    message: control.FromWorker


@dataclass(frozen=True)
class Misbehaved:
    """A worker sent a message that does not fit its schema: it is to be replaced."""

    worker: WorkerHandle
    cause: str


class ControlPlane(Service):
    """Receives the workers' messages and publishes them; sends the workers the pool's."""

    name = "plane"

    def __init__(self, address: str, bus: Bus, clock: Clock = SYSTEM) -> None:
        self.address = address
        self.bus = bus
        self.routes: dict[bytes, WorkerHandle] = {}  # the live workers, by routing identity
        self.names: dict[str, WorkerHandle] = {}  # ... and by name
        self._buried: deque[bytes] = deque(maxlen=64)  # routes of workers that exited
        self.refusals = control.Refusals(clock=clock.monotonic)
        self.log = log("pool")

    async def start(self) -> None:
        self.bind()

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {"plane-receive": self.receive()}

    async def stop(self, steps: Steps) -> None:
        self.close()

    def bind(self) -> None:
        """Bind the ROUTER socket (owner-only for an ipc address)."""
        self.zmq = zmq.asyncio.Context()
        self.router = self.zmq.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a connected identity stays its own
        self.router.setsockopt(zmq.MAXMSGSIZE, control.MAX_FRAME)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.address)
        if self.address.startswith("ipc://"):
            os.chmod(self.address.removeprefix("ipc://"), 0o600)  # in a 0700 directory

    def close(self) -> None:
        self.router.close()
        self.zmq.term()

    def live(self) -> Mapping[str, WorkerHandle]:
        """The live workers by name, as a view that follows admissions and burials."""
        return MappingProxyType(self.names)

    def admit(self, worker: WorkerHandle) -> None:
        """A worker was spawned with this route: its frames are read from now on."""
        self.routes[worker.route] = worker
        self.names[worker.identity] = worker

    def bury(self, worker: WorkerHandle) -> None:
        """The worker exited: its last frames are dropped without a word."""
        if self.routes.pop(worker.route, None) is not None:
            self._buried.append(worker.route)
        if self.names.get(worker.identity) is worker:
            del self.names[worker.identity]

    async def receive(self) -> None:
        """Read and handle the workers' messages until cancelled."""
        while True:
            route, *frames = await self.router.recv_multipart()
            try:
                self._on_frames(route, frames)
            except Exception:
                self.log.exception("control plane: a message could not be handled; going on")

    def send(self, worker: WorkerHandle, type: str, **fields: Any) -> bool:
        """Send a control message; False if the worker is not connected (any more)."""
        try:
            self.router.send_multipart(
                [worker.route, control.encode(type, **fields)], flags=zmq.NOBLOCK
            )
            return True
        except zmq.ZMQError as exc:
            self.log.warning("control plane: cannot send {} to {}: {}", type, worker.identity, exc)
            return False

    def _on_frames(self, route: bytes, frames: list[bytes]) -> None:
        worker = self.routes.get(route)
        if worker is None:
            if route not in self._buried and not self.refusals.seen(route):
                reason = control.stranger(route, frames, self._secret_of)
                self._refuse(f"peer {control.printable(route)}", route, reason)
            return
        if worker.replacing:
            return
        try:
            message = control.decode(frames, control.WORKER_MESSAGES)
            control.check_sender(message, worker.identity, worker.secret, worker.pid)
        except control.ProtocolError as exc:
            if worker.hello:
                self.bus.publish(Misbehaved(worker, str(exc)))
            else:
                self._refuse(f"worker {worker.identity}", route, f"{exc} (before its hello)")
            return
        if not worker.hello and not isinstance(message, control.Hello):
            self._refuse(f"worker {worker.identity}", route, f"a {message.type} before its hello")
            return
        self.bus.publish(Said(worker, message))

    def _secret_of(self, name: str) -> str | None:
        worker = self.names.get(name)
        return worker.secret if worker is not None else None

    def _refuse(self, who: str, route: bytes, reason: str) -> None:
        unlogged = self.refusals.first(route)
        if unlogged is not None:
            self.log.warning(
                "control plane: refused {}: {}; dropping what it sends{}",
                who,
                reason,
                f" ({unlogged} more refused peers not logged)" if unlogged else "",
            )
