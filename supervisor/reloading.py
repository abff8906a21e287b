"""A reload (SIGHUP, `turnkeeper reload`, `POST /v1/reload`): the configuration read
again, refused as a start refuses it, or applied as far as it may change live.

One reload at a time (a lock), in this order:

1. Read the file and the environment as `run` does, make the start's checks
   (`check_plugins`: the agents, the model, the MCP and task commands, the delivery
   secrets, the tokens file) and read the tokens as the start reads them. A failure is
   the start's one line, and nothing changes.
2. Compare with the configuration in force (`supervisor.core.reload`): each changed key is
   live, the workers', or needs a restart; those that need a restart keep their old
   values, and the result names them.
3. Swap the configuration in force into every part of the supervisor that reads one (the
   daemon's own through `on_config`; the pool, ownership, recovery, the subagents'
   reconciler, the task keeper, the scheduler, the courier, the API and its routes), the
   tokens into the live `Tokens`, the log level into the supervisor's logger.
4. Resize the pool: slots added start their workers at once; slots retired hand their
   sessions over at event boundaries first. Then, if a key the workers read changed,
   replace the other workers (the rolling restart): no turn is lost or run twice.
   `reload(workers=True)` replaces them whatever changed (a fixed MCP server that was
   down, agent code upgraded in place).

`reload(wait=False)` returns after step 3, with step 4 under way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from supervisor.contract.config import (
    Config,
    ConfigError,
    config_version,
    load_config,
    masked_data,
    resolve_paths,
)
from supervisor.contract.logs import log, setup_logging
from supervisor.core import reload as rules
from supervisor.core.reload import Change
from supervisor.http.app import Api
from supervisor.http.auth import Tokens
from supervisor.pool.pool import Pool
from supervisor.preflight import PluginError, check_plugins, read_tokens

ROLL_TIMEOUT = 60.0  # seconds for each worker replaced or slot retired (the rolling restart's)

__all__ = ["Change", "ReloadResult", "Reloader"]


@dataclass
class ReloadResult:
    """What a reload did; `error` is the start's one line when it was refused."""

    ok: bool
    error: str | None
    version_before: str
    version: str  # in force now
    loaded_at: float  # when the configuration in force was loaded
    changes: list[Change] = field(default_factory=list)
    needs_restart: list[str] = field(default_factory=list)  # keys left as they were
    workers_replaced: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: the API's `ReloadOut`."""
        return {
            "ok": self.ok,
            "error": self.error,
            "version_before": self.version_before,
            "version": self.version,
            "loaded_at": self.loaded_at,
            "changes": [change.as_dict() for change in self.changes],
            "needs_restart": list(self.needs_restart),
            "workers_replaced": self.workers_replaced,
        }


class Reloader:
    """Reloads the daemon's configuration (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        config_path: str | None,
        *,
        pool: Pool,
        api: Api,
        on_config: Callable[[Config], None],
    ) -> None:
        self.config = config  # in force
        self.config_path = config_path  # `run --config`; None: as `load_config` finds it
        self.pool = pool
        self.api = api
        self.on_config = on_config
        self.paths = resolve_paths(config)  # the admin token's: daemon.state_dir is fixed
        self.version = config_version(config)
        self.loaded_at = time.time()
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[ReloadResult]] = set()
        self.log = log("reload")

    def load(self) -> Config:
        """The configuration on disk and in the environment, if a start would take it
        (blocking: run it in a thread). Raises ConfigError or PluginError, whose message
        is the start's one line."""
        return self._read()[0]

    def _read(self) -> tuple[Config, Tokens]:
        config = load_config(self.config_path)
        check_plugins(config)
        try:
            return config, read_tokens(config, self.paths)
        except OSError as exc:  # the admin token cannot be read or written
            raise PluginError(f"{self.paths.admin_token_file}: {exc.strerror or exc}") from exc

    async def reload(self, *, wait: bool = True, workers: bool = False) -> ReloadResult:
        """Read the configuration again and apply it; never raises for a bad one (the
        result says why). With `wait` False, returns once it is applied to the
        supervisor and the pool's changes have begun; with `workers`, every worker is
        replaced even if no key they read changed."""
        applied: asyncio.Future[ReloadResult] | None = None
        if not wait:
            applied = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._reload(applied, workers), name="reload")
        self._running.add(task)
        task.add_done_callback(self._ended)
        if applied is None:
            return await task
        return await asyncio.shield(applied)

    def _ended(self, task: asyncio.Task[ReloadResult]) -> None:
        self._running.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log.opt(exception=exc).error("the reload failed: {!r}", exc)

    async def _reload(
        self, applied: asyncio.Future[ReloadResult] | None, workers: bool
    ) -> ReloadResult:
        try:
            async with self._lock:
                result, grown = await self._take(workers)
                if applied is not None:
                    applied.set_result(result)
                if result.ok and not self.pool.stopping:
                    await self._resize_and_replace(result, grown)
                return result
        except BaseException as exc:
            if applied is not None and not applied.done():
                if isinstance(exc, asyncio.CancelledError):
                    applied.cancel()
                else:
                    applied.set_exception(exc)
            raise

    async def _take(self, workers: bool) -> tuple[ReloadResult, list[int]]:
        """Steps 1 to 3, and the slots to add started; the result and the slots added."""
        before, version_before = self.config, self.version
        try:
            new, tokens = await asyncio.to_thread(self._read)
            found, in_force = _judge(before, new)
        except (ConfigError, PluginError) as exc:
            self.log.error("refused, configuration {} stays in force: {}", version_before, exc)
            refused = ReloadResult(False, str(exc), version_before, version_before, self.loaded_at)
            return refused, []
        version, loaded_at = config_version(in_force), self.loaded_at
        if version != version_before:
            self.config, loaded_at = in_force, time.time()
            self.on_config(in_force)
            await self._swap(before, in_force)
        self._take_tokens(tokens)  # also when no key changed: the file's lines may have
        result = ReloadResult(
            True,
            None,
            version_before,
            version,
            loaded_at,
            found,
            needs_restart=[c.key for c in found if c.effect == "restart"],
            workers_replaced=workers or any(c.effect == "workers" for c in found),
        )
        self._say(result)
        grown = [] if self.pool.stopping else self.pool.grow()
        # Said last: a status that shows this version shows the slots it added.
        self.version, self.loaded_at = version, loaded_at
        return result, grown

    async def _swap(self, before: Config, config: Config) -> None:
        """Every part of the supervisor that reads the configuration reads `config` now."""
        pool = self.pool
        pool.config = config
        pool.ownership.config = config
        pool.recovery.configure(config)
        pool.subagents.config = config
        pool.task_keeper.config = config
        pool.scheduler.config = config
        await pool.courier.reconfigure(config)
        self.api.reconfigure(config)
        if before.log != config.log:
            setup_logging(config.log.level, config.log.format)

    def _take_tokens(self, tokens: Tokens) -> None:
        live = self.api.tokens
        old, new = live.principals(), tokens.principals()
        if old != new:
            self.log.info(
                "tokens: {} principals (added: {}; removed: {}; with a new token: {})",
                len(new),
                ", ".join(sorted(new.keys() - old.keys())) or "none",
                ", ".join(sorted(old.keys() - new.keys())) or "none",
                ", ".join(sorted(p for p in new.keys() & old.keys() if new[p] != old[p])) or "none",
            )
        live.take(tokens)

    def _say(self, result: ReloadResult) -> None:
        for change in result.changes:
            if change.effect == "restart":
                self.log.warning(
                    "{} changed ({} -> {}) but needs a restart: left as it was",
                    change.key,
                    change.before,
                    change.after,
                )
            else:
                self.log.info(
                    "{}: {} -> {} ({})", change.key, change.before, change.after, change.effect
                )
        if result.version == result.version_before:
            self.log.info("configuration {} unchanged", result.version)
        else:
            self.log.info(
                "configuration {} -> {}{}",
                result.version_before,
                result.version,
                "; replacing the workers" if result.workers_replaced else "",
            )

    async def _resize_and_replace(self, result: ReloadResult, grown: list[int]) -> None:
        """Step 4: slots retired, the other workers replaced if need be, slots added ready."""
        pool = self.pool
        kept = [slot.index for slot in pool.slots if slot.index not in grown]
        await pool.shrink(ROLL_TIMEOUT)
        if result.workers_replaced:
            await pool.rolling_restart(ROLL_TIMEOUT, only=kept)
        if grown and not await pool.settled(grown, ROLL_TIMEOUT):
            self.log.warning("slot {} added, but not every worker there is ready yet", grown)
        pool.settle_spares()
        if result.version != result.version_before:
            self.log.info("configuration {} in force", result.version)


def _judge(before: Config, new: Config) -> tuple[list[Change], Config]:
    """The changes from `before` to `new`, and the configuration in force after them (the
    keys that need a restart as they were). Raises ConfigError if that does not validate."""
    old_data = before.model_dump(mode="json", by_alias=True)
    new_data = new.model_dump(mode="json", by_alias=True)
    found = rules.changes(old_data, new_data, masked_data(before), masked_data(new))
    try:
        in_force = Config.model_validate(rules.in_force(old_data, new_data))
    except (ValidationError, ValueError) as exc:
        reason = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        raise ConfigError(
            f"with the keys that need a restart left as they were, the configuration does "
            f"not hold together: {reason}"
        ) from None
    in_force._source = new.source
    return found, in_force
