"""sd_notify: a few lines over a unix datagram socket (sd_notify(3)).

`Notifier.from_environ()` takes NOTIFY_SOCKET (and the watchdog settings) out of this
process's environment, so no child inherits them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

from supervisor.contract.clock import SYSTEM


class Notifier:
    """Talks to systemd when it is listening; does nothing otherwise."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._socket: socket.socket | None = None
        if address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """Read and remove NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID."""
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", None)
        usec = env.pop("WATCHDOG_USEC", None)
        pid = env.pop("WATCHDOG_PID", None)
        watchdog = int(usec) if usec and usec.isdigit() and int(usec) > 0 else None
        if pid and pid.isdigit() and int(pid) != os.getpid():
            watchdog = None  # the watchdog is meant for another process
        return cls(address, watchdog)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half the timeout, as sd_notify(3) advises."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, **fields: str | int) -> bool:
        """Send `KEY=value` lines; False if nobody listens or the send failed."""
        if self._socket is None or not self.address:
            return False
        text = "\n".join(f"{key}={value}" for key, value in fields.items())
        target = self.address
        if target.startswith("@"):  # an abstract socket
            target = "\0" + target[1:]
        try:
            self._socket.sendto(text.encode(), target)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> None:
        if self.watchdog_usec:  # as it was before a restart in place widened it
            self.send(READY=1, STATUS=status, WATCHDOG_USEC=self.watchdog_usec)
        else:
            self.send(READY=1, STATUS=status)

    def status(self, status: str) -> None:
        self.send(STATUS=status)

    def stopping(self, status: str) -> None:
        self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> None:
        self.send(WATCHDOG=1)

    def reloading(self, status: str, timeout: float) -> None:
        """A restart in place begins: RELOADING=1 with MONOTONIC_USEC (systemd 253 wants it
        to tell this reload from an earlier one); READY=1 from the new boot ends it. With a
        watchdog, its timeout is widened to `timeout` seconds for the stop and the start
        (`ready` sets it back)."""
        fields: dict[str, str | int] = {
            "RELOADING": 1,
            "MONOTONIC_USEC": int(SYSTEM.monotonic() * 1_000_000),  # CLOCK_MONOTONIC
            "STATUS": status,
        }
        if self.watchdog_usec:
            fields["WATCHDOG_USEC"] = int(max(timeout * 1e6, self.watchdog_usec))
        self.send(**fields)

    def environ(self) -> dict[str, str]:
        """The variables `from_environ` took, for a process that replaces this one in place
        (the same pid: `supervisor.restarts.service.reexec`)."""
        found: dict[str, str] = {}
        if self.address:
            found["NOTIFY_SOCKET"] = self.address
        if self.watchdog_usec:
            found["WATCHDOG_USEC"] = str(self.watchdog_usec)
            found["WATCHDOG_PID"] = str(os.getpid())
        return found

    def waiting(self, status: str, seconds: float) -> None:
        """A start that waits (for the database): STATUS= says for what, and the start
        timeout is extended by `seconds` from now (EXTEND_TIMEOUT_USEC, to be sent again
        before they run out); the watchdog is fed meanwhile, for a start in place."""
        fields: dict[str, str | int] = {"STATUS": status, "EXTEND_TIMEOUT_USEC": int(seconds * 1e6)}
        if self.watchdog_usec:
            fields["WATCHDOG"] = 1
        self.send(**fields)

    def extend_timeout(self, seconds: float) -> None:
        """Ask for more stop time (during a drain): EXTEND_TIMEOUT_USEC."""
        self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
