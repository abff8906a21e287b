"""Prometheus metrics, served by the supervisor from one registry.

Workers write no metric files (prometheus multiprocess mode leaks files of dead pids):
what they do reaches the supervisor over the control plane (every committed event, and
in each heartbeat their append latencies since the last one and their MCP servers by
state), and the pool's and the store's state is read at scrape time. Every label value
comes from a fixed vocabulary (the control plane's schema checks what workers send), so
no peer can create a series; the one exception is `host_id`, which names the daemons on
the database (operator-set, checked by the configuration; only live ones or those still
holding leases get a series).

A few gauges exist so that an alert can be written at all (the shipped rules in
`etc/prometheus/`): whether the database takes writes, and the free space of the state
directory's file system. Both are read from state that is kept anyway: the storage health
intake keeps, the host row's renewal every second (a write on every backend), and one
`statvfs` per scrape.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from supervisor.contract.control import APPEND_BUCKETS, ModelErrorKind
from supervisor.core.vocabulary import (
    MCP_REPORTED,
    AttemptOutcome,
    DeliveryStatus,
    EventType,
    FireOutcome,
    RestartState,
    SessionCount,
    SlotState,
    SubagentStatus,
    TaskStatus,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


HOST_STATES = ("live", "left", "lost")  # a host row's, as `supervisor.http.hosts` reads it


class _State(Collector):
    """What is read at scrape time: workers, sessions, subagents, MCP servers, hosts."""

    def __init__(self) -> None:
        self.pool: Callable[[], dict[str, Any]] = lambda: {"slots": [], "restarts": 0}
        self.sessions: Callable[[], Mapping[str, int]] | None = None
        self.subagents: Callable[[], Mapping[str, int]] | None = None  # `subagents.counts`
        self.tasks: Callable[[], Mapping[str, int]] | None = None  # `tasks.counts`
        self.deliveries: Callable[[], Mapping[str, int]] | None = None  # `deliveries.counts`
        self.restarts: Callable[[], Mapping[str, int]] | None = None  # `restarts.counts`
        self.mcp: Callable[[], Mapping[str, int]] = dict
        self.host_id = ""  # this daemon's daemon.host_id
        self.hosts: Callable[[], list[dict[str, Any]]] | None = None  # `hosts.read`
        self.storage: Callable[[], bool] | None = None  # intake's view: no write failed since
        self.failing: set[str] = set()  # the loops whose latest pass failed
        self.state_dir = ""  # its file system's free space is a gauge

    def collect(self) -> Iterator[Metric]:
        status = self.pool()
        restarts = CounterMetricFamily(
            "turnkeeper_worker_restarts", "Worker processes that died without being asked to."
        )
        restarts.add_metric([], status.get("restarts", 0))
        yield restarts
        workers = GaugeMetricFamily(
            "turnkeeper_workers", "Worker slots by state.", labels=["state"]
        )
        counts: dict[str, int] = {}
        for slot in status.get("slots", []):
            counts[slot["state"]] = counts.get(slot["state"], 0) + 1
        for state in SlotState:
            workers.add_metric([state], counts.get(state, 0))
        yield workers
        model = GaugeMetricFamily(
            "turnkeeper_model_up",
            "1 while the model answers; 0 while a worker waits out an outage (a server down, "
            "5xx, 429 or timing out).",
        )
        model.add_metric([], 0 if status.get("model", {}).get("state") == "unavailable" else 1)
        yield model
        mcp = GaugeMetricFamily(
            "turnkeeper_mcp_servers", "MCP servers of the live workers, by state.", labels=["state"]
        )
        states = self.mcp()
        for mcp_state in MCP_REPORTED:
            mcp.add_metric([mcp_state], states.get(mcp_state, 0))
        yield mcp
        if self.sessions is not None:
            yield _by_label(
                "turnkeeper_sessions",
                "Sessions by state (running and pending are among the open ones).",
                "state",
                SessionCount,
                self.sessions,
            )
        if self.subagents is not None:
            yield _by_label(
                "turnkeeper_subagents",
                "Subagents by status (running: no result given to the parent yet).",
                "status",
                SubagentStatus,
                self.subagents,
            )
        if self.tasks is not None:
            yield _by_label(
                "turnkeeper_tasks",
                "Background tasks by status (pending and running are live; the rest outcomes).",
                "status",
                TaskStatus,
                self.tasks,
            )
        if self.deliveries is not None:
            yield _by_label(
                "turnkeeper_deliveries",
                "Deliveries in the outbox by status (pending: not yet answered 2xx; dead: "
                "refused or out of attempts, until retried).",
                "status",
                DeliveryStatus,
                self.deliveries,
            )
        if self.restarts is not None:
            yield _by_label(
                "turnkeeper_restart_requests",
                "Requested restarts by state (pending: not begun; restarting: the daemon is "
                "stopping for it; done: settled by the next boot).",
                "state",
                RestartState,
                self.restarts,
            )
        yield from self._hosts()
        yield from self._storage()

    def _storage(self) -> Iterator[Metric]:
        """Whether the database takes writes, and the state directory's free space."""
        if self.storage is not None:
            up = GaugeMetricFamily(
                "turnkeeper_storage_up",
                "1 while the database takes writes; 0 once a write failed (a request intake "
                "could not store, or the renewal of this daemon's host row), until one works.",
            )
            up.add_metric([], 1 if self.storage() and "hosts" not in self.failing else 0)
            yield up
        if self.state_dir:
            try:
                usage = shutil.disk_usage(self.state_dir)
            except OSError:
                return  # the directory is gone: no sample, rather than a wrong one
            free = GaugeMetricFamily(
                "turnkeeper_state_dir_free_bytes",
                "Bytes an unprivileged user may still write on the file system of the "
                "daemon's state directory (the SQLite database, task output, the admin token).",
            )
            free.add_metric([], usage.free)
            yield free
            size = GaugeMetricFamily(
                "turnkeeper_state_dir_size_bytes",
                "Size in bytes of the file system of the daemon's state directory.",
            )
            size.add_metric([], usage.total)
            yield size

    def _hosts(self) -> Iterator[Metric]:
        """This daemon's host id, and the hosts on the database: one read per scrape."""
        if self.host_id:
            info = GaugeMetricFamily(
                "turnkeeper_host_info", "This daemon's daemon.host_id.", labels=["host_id"]
            )
            info.add_metric([self.host_id], 1)
            yield info
        if self.hosts is None:
            return
        try:
            rows = self.hosts()
        except Exception:
            rows = None  # a busy database: leave the families empty for this scrape
        by_state = GaugeMetricFamily(
            "turnkeeper_hosts", "Daemons on the database, by state.", labels=["state"]
        )
        states = [h["state"] for h in rows or ()]
        for state in HOST_STATES if rows is not None else ():
            by_state.add_metric([state], states.count(state))
        yield by_state
        sessions = GaugeMetricFamily(
            "turnkeeper_host_sessions",
            "Sessions each daemon's workers hold a live lease on (live daemons, and any "
            "other still holding leases).",
            labels=["host_id"],
        )
        for host in rows or ():
            if host["state"] == "live" or host["sessions"]:
                sessions.add_metric([host["id"]], host["sessions"])
        yield sessions


def _by_label(
    name: str,
    documentation: str,
    label: str,
    values: Iterable[str],
    read: Callable[[], Mapping[str, int]],
) -> GaugeMetricFamily:
    """A gauge of counts read from the store, one sample per value (0 included)."""
    family = GaugeMetricFamily(name, documentation, labels=[label])
    try:
        counts = read()
    except Exception:
        return family  # a busy database: leave the family empty for this scrape
    for value in values:
        family.add_metric([value], counts.get(value, 0))
    return family


class _Deltas(Collector):
    """A histogram summed from the deltas the workers send (`control.Histogram.take`)."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...]) -> None:
        self.name, self.documentation, self.bounds = name, documentation, bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def add(self, counts: Sequence[int], total: float) -> None:
        """Add one delta: counts per bucket (validated by the control plane's schema)."""
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} bucket counts, not {len(self.counts)}")
        with self._lock:
            for index, count in enumerate(counts):
                self.counts[index] += count
            self.sum += total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], buckets, total)
        yield family


class TurnClock:
    """Times turns from the commits this daemon hears of, into `turnkeeper_turn_seconds`.

    A turn is timed from its `turn_started` (or a `continuation`) to its `turn_ended`; one
    whose start this boot never heard of (it began before a restart, or on another host)
    is not timed. At most `cap` turns are followed at once: a start whose end never comes
    (its session moved to another host) cannot grow the map for good.
    """

    def __init__(self, metrics: Metrics, cap: int = 10000) -> None:
        self.metrics = metrics
        self.cap = cap
        self.began: dict[str, float] = {}

    def heard(self, session_id: str, kind: str, now: float) -> None:
        """An event of `kind` was committed for the session at `now` (monotonic)."""
        if kind in (EventType.TURN_STARTED, EventType.CONTINUATION):
            self.began.pop(session_id, None)
            if len(self.began) >= self.cap:
                del self.began[next(iter(self.began))]  # the oldest start
            self.began[session_id] = now
        elif kind == EventType.TURN_ENDED:
            began = self.began.pop(session_id, None)
            if began is not None:
                self.metrics.turn_seconds.observe(max(0.0, now - began))


class _SpansDropped(Collector):
    """Spans that could not be exported (a full queue, a collector down or slow), by
    process: the workers' added from their heartbeats, the supervisor's read at scrape."""

    def __init__(self) -> None:
        self.workers = 0
        self.supervisor: Callable[[], int] = lambda: 0  # `Tracing.dropped`, once it is on
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.workers += count

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "turnkeeper_spans_dropped",
            "Spans of traces not exported (the export queue was full, or the collector "
            "refused them or did not answer in time), by process: supervisor or worker.",
            labels=["process"],
        )
        family.add_metric(["supervisor"], self.supervisor())
        with self._lock:
            family.add_metric(["worker"], self.workers)
        yield family


class Metrics:
    """The daemon's metrics; docs/reference/metrics.md lists them (generated from here)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.events_committed = Counter(
            "turnkeeper_events_committed", "Events committed, by type.", ["type"], registry=r
        )
        self.model_tokens = Counter(
            "turnkeeper_model_tokens",
            "Tokens the model's answers cost (the server's counts, else estimates), by kind: "
            "prompt or completion.",
            ["kind"],
            registry=r,
        )
        self.model_errors = Counter(
            "turnkeeper_model_errors",
            "Model calls that failed, as the workers saw them, by kind: transient (a timeout, "
            "a refused connection, 429 or 5xx: waited out as an outage) or permanent (another "
            "4xx, a malformed answer: the turn fails).",
            ["kind"],
            registry=r,
        )
        for kind in get_args(ModelErrorKind):
            self.model_errors.labels(kind)
        self.compactions = Counter(
            "turnkeeper_compactions",
            "Compactions committed: a session's older turns replaced by a summary (or "
            "dropped) to fit the model's context window.",
            registry=r,
        )
        self.loop_passes = Counter(
            "turnkeeper_loop_passes",
            "Passes of the daemon's reconcile loops, by loop and outcome (ok, or failed: "
            "the loop tries again after its retry).",
            ["loop", "outcome"],
            registry=r,
        )
        self.intake_replays = Counter(
            "turnkeeper_intake_replays",
            "Requests intake answered from an earlier commit (the same Idempotency-Key and "
            "body), by the type of the event they made; nothing new was committed.",
            ["type"],
            registry=r,
        )
        self.intake_rejections = Counter(
            "turnkeeper_intake_rejections",
            "Requests intake refused, by reason.",
            ["reason"],
            registry=r,
        )
        self.connections_evicted = Counter(
            "turnkeeper_http_connections_evicted",
            "Idle connections closed to make room under http.max_connections.",
            registry=r,
        )
        self.recovery = Counter(
            "turnkeeper_session_recovery",
            "Recovery decisions about interrupted turns, by action, cause and outcome.",
            ["action", "cause", "outcome"],
            registry=r,
        )
        self.recovery_age = Histogram(
            "turnkeeper_session_recovery_age_seconds",
            "How long a turn had been interrupted when a continuation attempt started.",
            buckets=(1, 5, 15, 30, 60, 300, 900, 1800, 3600),
            registry=r,
        )
        self.recovery_refunds = Counter(
            "turnkeeper_session_recovery_refunds",
            "Continuation attempts charged and then given back (no worker took the session).",
            registry=r,
        )
        self.subagent_recovery = Counter(
            "turnkeeper_subagent_recovery",
            "The reconciler's steps on running subagents, by action (report, resume, "
            "finalize, wedge, fail, skip).",
            ["action"],
            registry=r,
        )
        self.schedule_fires = Counter(
            "turnkeeper_schedule_fires",
            "Scheduled times of schedules, by outcome: fired on time, caught_up (the newest "
            "missed while no daemon ran, misfire run_once), skipped (missed and not run).",
            ["outcome"],
            registry=r,
        )
        for outcome in FireOutcome:  # every series from the start, at 0
            self.schedule_fires.labels(outcome)
        self.task_reconcile = Counter(
            "turnkeeper_task_reconcile",
            "The task keeper's steps, by action (start, report, lost, retry).",
            ["action"],
            registry=r,
        )
        self.delivery_attempts = Counter(
            "turnkeeper_delivery_attempts",
            "Attempts at deliveries, by outcome: delivered (2xx), failed (sent again after "
            "the backoff), dead (refused, or the last attempt).",
            ["outcome"],
            registry=r,
        )
        for attempt in AttemptOutcome:
            self.delivery_attempts.labels(attempt)
        self.delivery_lag = Histogram(
            "turnkeeper_delivery_lag_seconds",
            "From the commit of an event to its target's 2xx, for each delivered one.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15, 60, 300, 1800),
            registry=r,
        )
        self.first_delta = Histogram(
            "turnkeeper_first_delta_seconds",
            "From the start of a model call to its first live output (a delta), as the "
            "worker measured it: the time a user waits before the answer starts to appear.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.deltas_dropped = Counter(
            "turnkeeper_deltas_dropped",
            "Deltas (live output, never stored) that did not reach a client, by where: "
            "stream (an attach stream's client was too slow to take them), worker (a gap in "
            "a turn's deltas: lost before the supervisor had them).",
            ["where"],
            registry=r,
        )
        for where in ("stream", "worker"):
            self.deltas_dropped.labels(where)
        self.turn_seconds = Histogram(
            "turnkeeper_turn_seconds",
            "From a turn's start (or continuation) to its end, as this daemon heard of their "
            "commits: how long a user waits for a whole turn.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
            registry=r,
        )
        self.spans_dropped = _SpansDropped()
        r.register(self.spans_dropped)
        self.breaker_tripped = Gauge(
            "turnkeeper_breaker_tripped",
            "1 while the crash-loop breaker suppresses side work, else 0.",
            registry=r,
        )
        self.shutdown_steps = Gauge(
            "turnkeeper_shutdown_step_seconds",
            "How long each step of the previous boot's stop took.",
            ["step"],
            registry=r,
        )
        self.append_latency = _Deltas(
            "turnkeeper_append_latency_seconds",
            "Time for an event append to commit, as the workers measured it.",
            APPEND_BUCKETS,
        )
        r.register(self.append_latency)
        self.state = _State()
        r.register(self.state)

    def loop_pass(self, loop: str, ok: bool) -> None:
        """One pass of a reconcile loop (`supervisor.runtime.loops.reconcile`)."""
        self.loop_passes.labels(loop, "ok" if ok else "failed").inc()
        if ok:
            self.state.failing.discard(loop)
        else:
            self.state.failing.add(loop)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
