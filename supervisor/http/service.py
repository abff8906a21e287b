"""The HTTP API as a service: the listener of `Api`'s application.

Started after every service the routes call (the pool, the task keeper, the courier, the
restarter, the reloader), so its stop comes first: intake refuses from the stop's first
moment (`Stopping` on the bus), the attach streams see the drain's events, and the
listener closes once the drain is over (its step: `attach.shutdown_timeout` for the
streams to end, and a second more).

It serves `http.max_connections` connections at most, fewer when the file descriptor
limit cannot hold them beside what the daemon keeps open for the rest (docs/architecture.md,
"File descriptors"): judged at its start, and again when a reload changes the pool.
"""

from __future__ import annotations

from supervisor.contract import fdlimit
from supervisor.contract.config import Config, parse_listen
from supervisor.contract.errors import StartupError
from supervisor.contract.logs import log
from supervisor.core import descriptors
from supervisor.http.app import Api
from supervisor.http.listener import Listener
from supervisor.runtime.service import Service, Steps


class HttpService(Service):
    """Serves `api` on `http.listen` from its start to its stop."""

    name = "http"
    needs = ("pool", "tasks", "courier", "restarter", "reloader")
    takes = ("http", "attach", "auth", "delivery", "restart")
    drains = True  # the attach streams carry the drain's events

    def __init__(self, config: Config, api: Api) -> None:
        self.config = config
        self.api = api
        self.listener: Listener | None = None

    async def start(self) -> None:
        cap = connection_cap(self.config)
        if cap.clamped:
            log("http").warning("{}", cap.explain())
        listener = Listener(
            self.api.app(),
            self.config.http,
            self.config.attach.shutdown_timeout,
            self.api.metrics.connections_evicted.inc,
            max_connections=cap.effective,
        )
        try:
            await listener.start(parse_listen(self.config.http.listen))
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise StartupError(f"http.listen {self.config.http.listen}: {reason}") from exc
        self.listener = listener

    def reconfigure(self, config: Config) -> None:
        self.config = config  # `http.listen` itself needs a restart: it is left as it was
        self.api.reconfigure(config)
        cap = connection_cap(config)  # a larger pool holds more descriptors
        if self.listener is not None and cap.effective != self.listener.max_connections:
            self.listener.set_max_connections(cap.effective)
            log("http").log(
                "WARNING" if cap.clamped else "INFO",
                "{}",
                cap.explain() if cap.clamped else f"serving at most {cap.effective} connections",
            )

    async def drain(self, deadline: float) -> None:
        if not self.api.restarting:  # a restart's drain takes messages for the next boot
            self.api.stopping = True  # also for a stop that no signal began (a fatal pool)

    async def stop(self, steps: Steps) -> None:
        self.api.stopping = True
        if self.listener is not None:
            cap = self.config.attach.shutdown_timeout + 1.0
            await steps.run("http listener", cap, self.listener.cleanup)


def connection_cap(config: Config) -> descriptors.Cap:
    """The connections to serve at most under this process's soft file descriptor limit."""
    soft, _ = fdlimit.current()
    return descriptors.cap(config.http.max_connections, soft, fdlimit.needs(config).reserve())
