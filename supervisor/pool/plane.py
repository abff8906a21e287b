"""The control plane: the ROUTER socket the workers talk to, and whom it listens to.

It trusts only what it handed out (see contract/control.py): a frame from a routing
identity no worker was spawned with is dropped, and logged once per peer; a worker is read
only after a hello with its spawn's secret; a message that does not fit its schema gets
the worker that sent it replaced. Nothing a peer sends can end the receive loop.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import zmq
import zmq.asyncio

from supervisor.contract import control
from supervisor.contract.logs import log
from supervisor.pool.handle import WorkerHandle

Handle = Callable[[WorkerHandle, control.FromWorker], None]
Replace = Callable[[WorkerHandle, str], None]


class ControlPlane:
    """Receives the workers' messages for the pool, and sends them its own."""

    def __init__(
        self,
        address: str,
        workers: Mapping[str, WorkerHandle],
        handle: Handle,
        replace: Replace,
        clock: Callable[[], float],
    ) -> None:
        self.address = address
        self.workers = workers  # the pool's, by name
        self.handle = handle  # a message of a worker that said its hello
        self.replace = replace  # a worker that sent a malformed message
        self.routes: dict[bytes, WorkerHandle] = {}  # by routing identity
        self._buried: deque[bytes] = deque(maxlen=64)  # routes of workers that exited
        self.refusals = control.Refusals(clock=clock)
        self.log = log("pool")

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

    def admit(self, worker: WorkerHandle) -> None:
        """A worker was spawned with this route: its frames are read from now on."""
        self.routes[worker.route] = worker

    def bury(self, worker: WorkerHandle) -> None:
        """The worker exited: its last frames are dropped without a word."""
        if self.routes.pop(worker.route, None) is not None:
            self._buried.append(worker.route)

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
                self.replace(worker, str(exc))
            else:
                self._refuse(f"worker {worker.identity}", route, f"{exc} (before its hello)")
            return
        if not worker.hello and not isinstance(message, control.Hello):
            self._refuse(f"worker {worker.identity}", route, f"a {message.type} before its hello")
            return
        self.handle(worker, message)

    def _secret_of(self, name: str) -> str | None:
        worker = self.workers.get(name)
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
