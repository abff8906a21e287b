"""The composition root: the one place turnkeeper's supervisor is put together.

`build` makes every service of one boot, each given in its constructor the services it
`needs` (and the bus, the metrics, the clock), and hands them to a `Root`, which orders
them by their needs, starts them in that order and stops them in reverse. Nothing is
assigned into a service after it is built; what one service tells the others goes over
the bus (`supervisor.runtime.bus`). docs/architecture.md draws the tree this builds;
`turnkeeper debug services` prints it from the code.

In start order (what each needs, in brackets):

    store                                  the database, closed last
    host            [store]                host row and boot row: taken first, left last
    recovery        [store, host]          the breaker; the judge of interrupted turns
    signals         [store]                PostgreSQL's wakes between daemons
    plane                                  the socket the workers talk to
    ownership       [store, recovery, plane]  who owns which session: the dispatch passes
    pool            [store, recovery, plane, ownership]  the worker processes and slots
    subagents       [store, recovery, pool]
    tasks           [store] after pool     background tasks and their runners
    schedules       [store, pool]
    courier         [store] after pool     deliveries
    reloader        [store, pool, tasks]
    restarter       [store, pool, reloader]
    http            [pool, tasks, courier, restarter, reloader]
    recovery-passes [recovery] after http  the boot scan, once the listener is up
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.contract import telemetry
from supervisor.contract.clock import SYSTEM, Clock
from supervisor.contract.config import Config
from supervisor.contract.logs import log
from supervisor.deliveries.service import Courier
from supervisor.http.app import Api
from supervisor.http.attach import Hub
from supervisor.http.auth import Tokens
from supervisor.http.service import HttpService
from supervisor.metrics import Metrics
from supervisor.pool.membership import Membership
from supervisor.pool.ownership import HostView, Ownership
from supervisor.pool.plane import ControlPlane
from supervisor.pool.pool import Pool
from supervisor.pool.recoverer import Recoverer, RecoveryPasses
from supervisor.pool.signals import Signals
from supervisor.reloading import Reloader
from supervisor.restarts.service import Restarter
from supervisor.runtime.bus import Bus, Woken
from supervisor.runtime.root import Root
from supervisor.runtime.service import Service, Steps
from supervisor.schedules.service import Scheduler
from supervisor.store import RestartInfo, Store
from supervisor.subagents.service import ChildEnding, Reconciler
from supervisor.tasks.service import TaskKeeper
from supervisor.tracing import TurnTraces

CONTROL_SOCKET = "control.sock"


class StoreService(Service):
    """The database: opened before the tree is built (every service is given it), closed
    after every other service stopped."""

    name = "store"

    def __init__(self, store: Store) -> None:
        self.store = store

    async def stop(self, steps: Steps) -> None:
        try:
            await asyncio.to_thread(self.store.close)
        except Exception as exc:  # a full disk: the stop goes on
            log("shutdown").error("closing the database failed: {}", exc)


@dataclass
class Hooks:
    """What the daemon itself (not a service) is told or asked by the tree."""

    end_boot: Callable[[], None]  # blocking: ends the boot row with the stop's outcome
    begin_restart: Callable[[RestartInfo], None]  # a restart request is due: stop for it
    stopping: Callable[[], bool]  # the daemon is stopping
    on_config: Callable[[Config], None]  # a reload put a configuration in force


@dataclass
class Tree:
    """One boot's services, and the few the daemon talks to itself."""

    root: Root
    bus: Bus
    metrics: Metrics
    membership: Membership
    pool: Pool
    api: Api
    reloader: Reloader
    restarter: Restarter
    traces: TurnTraces


def workers(
    config: Config,
    store: Store,
    boot_id: str,
    address: str,
    recovery: Recoverer,
    metrics: Metrics,
    bus: Bus,
    *,
    hosts: HostView | None = None,
    announce: Callable[[str], None] | None = None,
    reaped_elsewhere: dict[str, int] | None = None,
    clock: Clock = SYSTEM,
    traces: TurnTraces | None = None,
) -> tuple[ControlPlane, Ownership, Pool]:
    """The three services of the worker processes: the control plane they talk to (bound
    at `address`), ownership of their sessions, and the pool that runs them."""
    plane = ControlPlane(address, bus, clock)
    ownership = Ownership(
        config,
        store,
        recovery,
        plane.live(),
        plane.send,
        clock,
        hosts=hosts,
        announce=announce,
        bus=bus,
        observer=metrics,
        traces=traces,
    )
    pool = Pool(
        config,
        store,
        boot_id,
        recovery,
        plane,
        ownership,
        metrics,
        bus=bus,
        reaped_elsewhere=reaped_elsewhere,
        clock=clock,
        traces=traces,
    )
    return plane, ownership, pool


def build(
    config: Config,
    config_path: str | None,
    store: Store,
    tokens: Tokens,
    hooks: Hooks,
    *,
    boot_id: str,
    host: str,
    runtime_dir: Path,
    state_dir: Path,
    clock: Clock = SYSTEM,
) -> Tree:
    """Every service of one boot, built in dependency order (see the module's docstring)."""
    bus, metrics = Bus(), Metrics()
    # This process's tracing, if the daemon started it: the runs' root spans.
    tracing = telemetry.active
    traces = TurnTraces(tracing, bus, clock)
    if tracing is not None:
        metrics.spans_dropped.supervisor = lambda: tracing.dropped
    membership = Membership(
        config, store, boot_id, host, bus=bus, metrics=metrics, ending=hooks.end_boot
    )
    ending = ChildEnding(store, bus, metrics)
    recovery = Recoverer(config, store, boot_id, host, metrics, give_up=ending.give_up, clock=clock)
    signals = Signals(store, lambda session: bus.publish(Woken(session)))
    socket_path = runtime_dir / CONTROL_SOCKET
    socket_path.unlink(missing_ok=True)  # stale; the daemon holds its lock
    runners: dict[str, int] = {}  # the task keeper's runners: the pool reaps them not
    plane, ownership, pool = workers(
        config,
        store,
        boot_id,
        f"ipc://{socket_path}",
        recovery,
        metrics,
        bus,
        hosts=membership,
        announce=signals.announce if signals.enabled else None,
        reaped_elsewhere=runners,
        clock=clock,
        traces=traces,
    )
    owner = recovery.owner_prefix
    subagents = Reconciler(config, store, recovery, pool, ending, metrics, bus=bus, clock=clock)
    keeper = TaskKeeper(
        config,
        store,
        bus.committed,
        metrics,
        host=host,
        boot_id=boot_id,
        owner=owner,
        state_dir=state_dir,
        bus=bus,
        runners=runners,
        clock=clock,
    )
    scheduler = Scheduler(config, store, owner, bus.committed, pool.interrupt, metrics, clock=clock)
    courier = Courier(config, store, owner, metrics, clock=clock, bus=bus)
    hub = Hub()
    root_box: list[Root] = []  # the reloader reconfigures the root it belongs to
    reloader = Reloader(
        config,
        config_path,
        store=store,
        pool=pool,
        keeper=keeper,
        tokens=tokens,
        hub=hub,
        reconfigure=lambda new: root_box[0].reconfigure(new),
        on_config=hooks.on_config,
        bus=bus,
    )
    restarter = Restarter(
        store,
        host=host,
        boot_id=boot_id,
        config=lambda: reloader.config,
        load=reloader.load,
        version=lambda: reloader.version,
        begin=hooks.begin_restart,
        committed=bus.committed,
        stopping=hooks.stopping,
        hold=pool.orphans_held,
        bus=bus,
        clock=clock,
    )
    api = Api(
        config,
        store,
        hub,
        tokens,
        metrics,
        boot_id=boot_id,
        pool=pool,
        keeper=keeper,
        courier=courier,
        reloader=reloader,
        restarts=restarter,
        bus=bus,
        host_id=host,
        clock=clock,
        traces=traces,
    )
    state = metrics.state
    state.pool, state.mcp = pool.status, pool.mcp_states
    state.sessions, state.subagents = store.sessions.counts, store.subagents.counts
    state.tasks, state.restarts = store.tasks.counts, store.restarts.counts
    state.storage, state.state_dir = (lambda: api.storage.error is None), str(state_dir)
    services: list[Service] = [
        StoreService(store),
        membership,
        recovery,
        signals,
        plane,
        ownership,
        pool,
        subagents,
        keeper,
        scheduler,
        courier,
        reloader,
        restarter,
        HttpService(config, api),
        RecoveryPasses(recovery),
    ]
    root = Root(services)
    root_box.append(root)
    return Tree(root, bus, metrics, membership, pool, api, reloader, restarter, traces)


def draw(tree: Tree) -> str:
    """The tree as its code declares it, in Markdown: each service in start order with
    what it needs, the sections it takes on a reload, whether it stays up through the
    drain and its loops; then who hears what on the bus. docs/architecture.md holds this
    text; `tests/project/test_structure.py` fails when the two differ."""
    lines = [
        "| # | service | class | needs | after | drains | takes live | loops |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, s in enumerate(tree.root.describe(), 1):
        lines.append(
            f"| {n} | `{s['name']}` | `{s['class']}` | {', '.join(s['needs']) or '-'} "
            f"| {', '.join(s['after']) or '-'} | {'yes' if s['drains'] else '-'} "
            f"| {', '.join(s['takes']) or '-'} | {', '.join(s['loops']) or '-'} |"
        )
    lines += ["", "| event | heard by |", "|---|---|"]
    for event, handlers in sorted(tree.bus.subscribers().items()):
        lines.append(f"| `{event}` | {', '.join(f'`{h}`' for h in handlers)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """`python -m supervisor.composition`: the tree of the built-in configuration, drawn
    (built on a throwaway SQLite database; nothing is started)."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        where = Path(directory)
        with Store(f"sqlite:///{where / 'structure.db'}") as store:
            hooks = Hooks(lambda: None, lambda _: None, lambda: False, lambda _: None)
            tree = build(
                Config(),
                None,
                store,
                Tokens({}),
                hooks,
                boot_id="0" * 32,
                host="host",
                runtime_dir=where,
                state_dir=where,
            )
            print(draw(tree), end="")


if __name__ == "__main__":
    main()
