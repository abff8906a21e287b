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
   tokens into the live `Tokens` (the attach streams of a principal whose token was
   revoked or replaced are hung up), the log level into the supervisor's logger, and add
   the slots `pool.workers` and `pool.spare` ask for. Nothing in this step awaits: the
   configuration, its version and the tokens change together or not at all.
4. Retire the slots beyond them (those that serve least first); then, if a key the
   workers read changed, replace the other workers (the rolling restart: no turn is lost
   or run twice) and start again the slots that gave up. `reload(workers=True)` replaces
   them whatever changed (a fixed MCP server that was down, agent code upgraded in place).
   A new worker that cannot start stops the rolling restart: the result's `incomplete`.

`reload(wait=False)` returns after step 3, with step 4 under way. A reload never raises:
whatever fails is its result's `error` (nothing changed) or `incomplete` (in force, the
pool not yet as it says), and the log's. `cancel()` (the daemon stops) ends the one under
way and refuses those that come after.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from supervisor.contract.background import spawn
from supervisor.contract.clock import SYSTEM
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
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens
from supervisor.http.reload_route import STARTED
from supervisor.pool.pool import Pool
from supervisor.preflight import PluginError, check_plugins, read_tokens
from supervisor.runtime.bus import Bus, Stopping
from supervisor.runtime.service import Service, Steps
from supervisor.store import Store
from supervisor.tasks.service import TaskKeeper

# Seconds a new worker has to be ready, and a worker being replaced or retired to hand its
# sessions over (then `shutdown.kill_grace` to exit).
ROLL_TIMEOUT = 60.0
STOPPING = "the daemon is stopping: the configuration was not read again"
STOPPED = "the daemon began to stop: the pool was left as it was then"
STOPPING_CODE, FAILED = "stopping", "failed"  # `ReloadResult.code` of refusals not the file's

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
    incomplete: str | None = None  # why the pool is not (yet) as the configuration says
    # Why it was refused, for the API's status: invalid_config (422: a start would refuse
    # it), stopping (503) or failed (500: an error of the daemon's, in its log).
    code: str = "ok"
    revoked: list[str] = field(default_factory=list)  # principals no longer in the tokens file
    # The MCP servers of the workers this reload started that did not start (worker,
    # server, state): the workers run without their tools.
    mcp_not_started: list[tuple[str, str, str]] = field(default_factory=list)

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
            "revoked": list(self.revoked),
            "workers_replaced": self.workers_replaced,
            "incomplete": self.incomplete,
            "mcp_not_started": [
                {"worker": worker, "server": server, "state": state}
                for worker, server, state in self.mcp_not_started
            ],
        }


class Reloader(Service):
    """Reloads the daemon's configuration (see the module's docstring)."""

    name = "reloader"
    needs = ("store", "pool", "tasks")

    def __init__(
        self,
        config: Config,
        config_path: str | None,
        *,
        store: Store,
        pool: Pool,
        keeper: TaskKeeper,
        tokens: Tokens,
        hub: Hub,
        reconfigure: Callable[[Config], None],
        on_config: Callable[[Config], None],
        bus: Bus | None = None,
        loaded_at: float = STARTED,  # `run` loads the configuration as the process starts
    ) -> None:
        self.config = config  # in force
        self.config_path = config_path  # `run --config`; None: as `load_config` finds it
        self.store = store
        self.pool = pool
        self.keeper = keeper  # a revoked principal's running tasks are signalled
        self.tokens = tokens  # the live tokens, which the API checks
        self.hub = hub  # the attach streams, hung up when their token is revoked
        self.reconfigure_all = reconfigure  # every service takes a configuration
        self.on_config = on_config
        self.paths = resolve_paths(config)  # the admin token's: daemon.state_dir is fixed
        self.version = config_version(config)
        self.loaded_at = loaded_at
        self.closed = False  # the daemon stops: no reload from now on
        self._lock = asyncio.Lock()
        self._running: set[asyncio.Task[ReloadResult]] = set()
        self.log = log("reload")
        if bus is not None:
            bus.subscribe(Stopping, self._stopping)

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
        """Read the configuration again and apply it; never raises (the result says what
        failed). With `wait` False, returns once it is applied to the supervisor and the
        pool's changes have begun; with `workers`, every worker is replaced even if no
        key they read changed. A caller that goes away does not cut it short."""
        if self.closed:
            return self._refused(STOPPING, STOPPING_CODE)
        applied: asyncio.Future[ReloadResult] = asyncio.get_running_loop().create_future()
        task = self._begin(applied, workers)
        try:
            return await asyncio.shield(task if wait else applied)
        except asyncio.CancelledError:
            if task.cancelled():  # `cancel` came before it began
                return self._refused(STOPPING, STOPPING_CODE)
            raise

    def begin(self) -> None:
        """A reload in the background (SIGHUP): only the log says what it did."""
        if not self.closed:
            self._begin(None, False)

    def cancel(self) -> asyncio.Future[list[Any]]:
        """The daemon stops: no reload from now on, and the one under way ends at once (it
        retires no slot and replaces no worker any further). Await the answer to wait
        until it has ended."""
        self.closed = True
        running = list(self._running)
        for task in running:
            task.cancel()
        return asyncio.gather(*running, return_exceptions=True)

    def _stopping(self, _: Stopping) -> None:
        self.cancel()  # a reload under way changes the pool no further

    async def stop(self, steps: Steps) -> None:
        await self.cancel()  # no slot retired or worker replaced during the stop

    def _begin(
        self, applied: asyncio.Future[ReloadResult] | None, workers: bool
    ) -> asyncio.Task[ReloadResult]:
        task = spawn(
            self._reload(applied, workers),
            name="reload",
            ended=functools.partial(self._ended, applied),
        )
        self._running.add(task)
        return task

    def _ended(
        self, applied: asyncio.Future[ReloadResult] | None, task: asyncio.Task[ReloadResult]
    ) -> None:
        self._running.discard(task)
        if task.cancelled():  # before it began: `_reload` answers every later cancel
            _settle(applied, self._refused(STOPPING, STOPPING_CODE))
        elif (exc := task.exception()) is not None:
            self.log.opt(exception=exc).error("the reload failed: {!r}", exc)

    async def _reload(
        self, applied: asyncio.Future[ReloadResult] | None, workers: bool
    ) -> ReloadResult:
        result: ReloadResult | None = None
        try:
            async with self._lock:
                if self.closed:  # it waited for the one before, and the daemon began to stop
                    result = self._refused(STOPPING, STOPPING_CODE)
                else:
                    result, added = await self._take(workers)
                    _settle(applied, result)
                    if result.ok and not self.pool.is_stopping():
                        await self._change_pool(result, added)
        except asyncio.CancelledError:  # `cancel`: the daemon stops
            if result is None:
                result = self._refused(STOPPING, STOPPING_CODE)
            else:
                result.incomplete = STOPPED
                self.log.info("{}", STOPPED)
        except Exception as exc:  # a bug; said, and the daemon goes on
            self.log.opt(exception=exc).error("the reload failed: {!r}", exc)
            if result is None:
                result = self._refused(f"the reload failed: {exc!r} (see the daemon's log)", FAILED)
            else:
                result.incomplete = f"changing the pool failed: {exc!r} (see the daemon's log)"
        _settle(applied, result)
        return result

    def _refused(self, error: str, code: str = "invalid_config") -> ReloadResult:
        result = ReloadResult(False, error, self.version, self.version, self.loaded_at)
        result.code = code
        return result

    async def _take(self, workers: bool) -> tuple[ReloadResult, list[int]]:
        """Steps 1 to 3, and the slots to add started; the result and the slots added."""
        before, version_before = self.config, self.version
        read_at = SYSTEM.time()
        try:
            with self.pool.orphans_held():  # the agent check's child is its own to reap
                new, tokens = await asyncio.to_thread(self._read)
            found, in_force = _judge(before, new)
        except (ConfigError, PluginError) as exc:
            self.log.error("refused, configuration {} stays in force: {}", version_before, exc)
            return self._refused(str(exc)), []
        except Exception as exc:
            self.log.opt(exception=exc).error("the configuration could not be read: {!r}", exc)
            return self._refused(f"the configuration could not be read: {exc!r}", FAILED), []
        version = config_version(in_force)
        known = self.tokens.principals().keys()
        try:
            self._apply(before, in_force, version, read_at, tokens)
        except Exception as exc:
            self.log.opt(exception=exc).error(
                "applying configuration {} failed, {} stays in force: {!r}",
                version,
                version_before,
                exc,
            )
            return self._refused(f"applying the configuration failed: {exc!r}", FAILED), []
        now_known = tokens.principals().keys()
        revoked = sorted(known - now_known)
        await self._revoke(revoked, sorted(now_known - known))
        result = ReloadResult(
            True,
            None,
            version_before,
            version,
            self.loaded_at,
            found,
            needs_restart=[c.key for c in found if c.effect == "restart"],
            revoked=revoked,
            workers_replaced=workers or any(c.effect == "workers" for c in found),
        )
        self._say(result)
        try:
            added = [] if self.pool.is_stopping() else self.pool.grow()
        except Exception as exc:
            self.log.opt(exception=exc).error("adding slots failed: {!r}", exc)
            result.incomplete = f"adding slots failed: {exc!r} (see the daemon's log)"
            added = []
        return result, added

    def _apply(
        self, before: Config, config: Config, version: str, loaded_at: float, tokens: Tokens
    ) -> None:
        """Step 3, whole or not at all (nothing here awaits): what fails is put back as it
        was, and raised."""
        kept = self.config, self.version, self.loaded_at, self.tokens.principals()
        try:
            if version != self.version:
                self._swap(config)
                self.on_config(config)
                if before.log != config.log:
                    setup_logging(config.log.level, config.log.format)
                self.config, self.version, self.loaded_at = config, version, loaded_at
            self._take_tokens(tokens)  # also when no key changed: the file's lines may have
        except Exception:
            self.config, self.version, self.loaded_at, principals = kept
            self.tokens.take(Tokens(principals))
            self._swap(before)  # each part takes it back as at a reload
            self.on_config(before)
            if before.log != config.log:
                setup_logging(before.log.level, before.log.format)
            raise

    def _swap(self, config: Config) -> None:
        """Every part of the supervisor that reads the configuration reads `config` now:
        each service takes it (`supervisor.runtime.root.Root.reconfigure`)."""
        self.reconfigure_all(config)

    def _take_tokens(self, tokens: Tokens) -> None:
        live = self.tokens
        old, new = live.principals(), tokens.principals()
        live.take(tokens)
        if old == new:
            return
        lost = sorted(p for p in old if new.get(p) != old[p])  # revoked, or a new token
        self.log.info(
            "tokens: {} principals (added: {}; removed: {}; with a new token: {})",
            len(new),
            ", ".join(sorted(new.keys() - old.keys())) or "none",
            ", ".join(sorted(old.keys() - new.keys())) or "none",
            ", ".join(p for p in lost if p in new) or "none",
        )
        ended = self.hub.hang_up(lost)
        if ended:
            self.log.info("hung up {} attach streams opened with a token no longer valid", ended)

    async def _revoke(self, revoked: list[str], restored: list[str]) -> None:
        """Stop what the principals the tokens file no longer lists set in motion: their
        schedules paused, their pending and running tasks cancelled (their requests in
        flight are refused by the API, which checks the token again before it writes).
        The schedules of principals listed again are resumed. A failure here is logged:
        the tokens are in force already."""
        store = self.store
        try:
            if restored:
                resumed = await asyncio.to_thread(store.schedules.resume_owned_by, restored)
                if resumed:
                    self.log.info("{} schedules of {} resumed", resumed, ", ".join(restored))
            if not revoked:
                return
            paused = await asyncio.to_thread(store.schedules.pause_owned_by, revoked)
            tasks = await asyncio.to_thread(store.tasks.live_of_principals, revoked)
            for task_id in tasks:
                if await asyncio.to_thread(store.tasks.cancel, task_id) is not None:
                    self.keeper.cancel(task_id)
            self.log.warning(
                "revoked {}: {} schedules paused, {} tasks cancelled",
                ", ".join(revoked),
                paused,
                len(tasks),
            )
        except Exception as exc:
            self.log.opt(exception=exc).error("stopping what {} set in motion failed", revoked)

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

    async def _change_pool(self, result: ReloadResult, added: list[int]) -> None:
        """Step 4: slots retired, the other workers replaced if need be, the slots that
        gave up started again, the slots added ready."""
        pool = self.pool
        kept = [index for index in pool.slot_indexes() if index not in added]
        await pool.shrink(ROLL_TIMEOUT)
        started = list(added)  # the slots whose workers this reload started
        if result.workers_replaced:
            stopped = await pool.rolling_restart(ROLL_TIMEOUT, only=kept)
            if stopped is None:
                added = [*added, *pool.revive()]
                started = [*kept, *added]
            else:
                result.incomplete, result.workers_replaced = stopped, False
        if added and not await pool.settled(added, ROLL_TIMEOUT):
            self.log.warning("slot {} started, but not every worker there is ready yet", added)
        pool.settle_spares()
        self._mcp_started(result, started)
        if result.incomplete is not None:
            self.log.error("configuration {} in force, but: {}", result.version, result.incomplete)
        elif result.version != result.version_before:
            self.log.info("configuration {} in force", result.version)

    def _mcp_started(self, result: ReloadResult, started: list[int]) -> None:
        """Whether the MCP servers of the workers the reload started are up: those that did
        not start are named, and the pool is not as the configuration says."""
        result.mcp_not_started = self.pool.mcp_not_started(started)
        if result.mcp_not_started and result.incomplete is None:
            result.incomplete = "MCP servers did not start: " + ", ".join(
                f"{server} (worker {worker}: {state})"
                for worker, server, state in result.mcp_not_started
            )


def _settle(applied: asyncio.Future[ReloadResult] | None, result: ReloadResult) -> None:
    if applied is not None and not applied.done():
        applied.set_result(result)


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
