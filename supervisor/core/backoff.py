"""The backoff policy: how long to wait before trying again something that keeps failing.

The one doubling wait of the project: the worker slots (`supervisor.core.slots`), the MCP
servers of a worker (`workers.mcp_server`), the command line's reconnects, the deliveries'
retries (`supervisor.deliveries.rules`, jittered), the store's retries of a busy database
(`supervisor.store.db`), a task runner's retries of its database work and a session
runner's of a write the database refused. Pure: the caller counts the failures and passes
them in.

Rules
-----
- After the n-th failure in a row the wait is `min(cap, initial * factor ** (n - 1))`: with
  the defaults 0.5, 1, 2, 4, 8, 16, 30, 30, ... seconds.
- `jittered` spreads that wait d over its upper half, [d / 2, d], by a number in [0, 1]
  the caller passes in (so that what one outage held back does not all come back at once).
- A run that lasted `healthy_after` seconds forgives the crashes before it: the next crash
  counts as the first one again.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """The waits between restarts of something that keeps crashing."""

    initial: float = 0.5  # wait after the first crash, in seconds
    factor: float = 2.0  # each further consecutive crash multiplies the wait by this
    cap: float = 30.0  # longest wait
    healthy_after: float = 60.0  # running this long forgives earlier crashes

    def __post_init__(self) -> None:
        if not (0 < self.initial <= self.cap and self.factor >= 1 and self.healthy_after >= 0):
            raise ValueError(f"need 0 < initial <= cap, factor >= 1, healthy_after >= 0: {self}")

    def delay(self, crashes: int) -> float:
        """The wait before a restart after `crashes` (at least 1) consecutive crashes."""
        try:
            raw = self.initial * self.factor ** (crashes - 1)
        except OverflowError:  # a crash loop long enough to overflow a float
            return self.cap
        return min(self.cap, raw)

    def jittered(self, failures: int, jitter: float) -> float:
        """`delay(failures)` d spread by `jitter` (in [0, 1]) over [d / 2, d]."""
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"need 0 <= jitter <= 1: {jitter}")
        full = self.delay(failures)
        return full / 2 + jitter * full / 2

    def delays(self, count: int) -> tuple[float, ...]:
        """The first `count` waits, `delay(1)` to `delay(count)`: a fixed number of tries."""
        return tuple(self.delay(n) for n in range(1, count + 1))

    def forgives(self, ran: float) -> bool:
        """Whether a run of `ran` seconds was long enough to forget the crashes before it."""
        return ran >= self.healthy_after


DEFAULT_BACKOFF = Backoff()
