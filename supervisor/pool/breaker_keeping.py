"""The breaker as recovery keeps it: judged from this host's boot log, told to the log,
the boot row and the metrics (the rules are `supervisor.core.breaker`'s)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from supervisor.contract.config import RecoveryConfig
from supervisor.core import breaker as breakers
from supervisor.core.engine import Memory
from supervisor.metrics import Metrics
from supervisor.store import Store

NOT_EVALUATED = "not evaluated yet"


class BreakerKeeping:
    """The breaker part of `supervisor.pool.recoverer.Recoverer`."""

    settings: RecoveryConfig
    store: Store
    host: str
    boot_id: str
    breaker: breakers.BreakerState
    memory: dict[str, Memory]
    metrics: Metrics
    log: Any

    def evaluate_breaker(self) -> breakers.BreakerState:
        """Read this host's boot log and judge the breaker (blocking; run in a thread)."""
        s = self.settings
        now = time.time()
        try:
            now = self.store.now()
            rows = self.store.boots.of_host(self.host, breakers.prune_before(now))
        except Exception as exc:
            self.log.error("cannot read the boot log: {}", exc)
            rows = None
        state = breakers.judge_rows(
            rows,
            now,
            s.breaker_threshold,
            s.breaker_window,
            is_current=lambda row: row.boot_id == self.boot_id,
        )
        previous, self.breaker = self.breaker, state
        first = previous.reason == NOT_EVALUATED
        if first or state.tripped != previous.tripped or state.fails_open != previous.fails_open:
            level = "WARNING" if state.tripped or state.fails_open else "INFO"
            self.log.log(
                level, "breaker {}: {}", "TRIPPED" if state.tripped else "clear", state.reason
            )
            for memory in self.memory.values():
                memory.quiet = None
            with contextlib.suppress(Exception):
                self.store.boots.set_breaker(self.boot_id, self.breaker_dict())
        self.metrics.breaker_tripped.set(1 if state.tripped else 0)
        return state

    def breaker_dict(self) -> dict[str, Any]:
        """The breaker for `/v1/status` and the boot row."""
        b = self.breaker
        return {
            "tripped": b.tripped,
            "unclean_boots": b.unclean_in_window,
            "threshold": self.settings.breaker_threshold,
            "window": self.settings.breaker_window,
            "clears_at": b.clears_at,
            "fails_open": b.fails_open,
            "reason": b.reason,
        }

    def prune(self) -> None:
        """Delete boot rows older than the retention (24 h)."""
        with contextlib.suppress(Exception):
            pruned = self.store.boots.prune(breakers.prune_before(self.store.now()))
            if pruned:
                self.log.info("pruned {} boot rows older than 24 h", pruned)
