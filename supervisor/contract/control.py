"""Control-plane messages between the supervisor (ROUTER) and its workers (DEALERs).

One JSON frame per message, with a `type`; every message has a typed schema below, and a
frame that does not fit one is not a message. The database is the source of truth: every
message only signals, and is safe to lose or to receive twice, because the receiver
re-reads the database before it acts.

worker -> supervisor (every one also names its `worker`, `w<slot>.<generation>`):
    hello       {pid, secret}                  connected: proves the spawn's secret
    ready       {}                             store open, MCP servers started: ready for
                                               sessions
    heartbeat   {sessions, turns,              alive; sent from the worker's event loop,
                 turns_served, mcp,            with its turns in flight, the turns it
                 append_latency,               ended since it started, each MCP server's
                 spans_dropped}                state by name, and the append latencies
                                               and spans it could not export since the
                                               last one
    committed   {session, seq, event_type,     an event was committed (a signal: readers
                 turn, follows, attempt}       read the event from the database); a turn's
                                               `turn_started`, `continuation` and
                                               `turn_ended` name the turn, and the event
                                               that opened the run a continuation follows
                                               and its attempt (the run's trace: see
                                               `supervisor.core.traces`)
    released    {session}                      stopped at an event boundary, lease released
    delta       {session, turn, index, text,   live output of a turn in flight: text the
                 tool_call, elapsed}           model streamed since the last delta, or the
                                               name of a tool call it makes; never stored,
                                               coalesced (at most one per DELTA_INTERVAL a
                                               turn), safe to lose (the committed
                                               model_response carries the whole text)
    lease_lost  {session}                      fenced out: the session is someone else's

supervisor -> worker:
    assign      {sessions: [{session, token,   own these sessions, each with its lease
                 reason, cause,                token; reason: an AssignReason; cause:
                 traceparent}]}                what stopped the turn (a Cause), for the
                                               continuation note; traceparent: the
                                               assignment's span (W3C), which the next run
                                               links to (one that does not parse is
                                               None). One message per worker and dispatch
                                               pass, at most MAX_ASSIGN
    release     {session}                      stop at the next event boundary, release
    wake        {session}                      re-read the session: there may be work
    interrupt   {session}                      cancel the turn in flight (operator)
    stop        {}                             release everything and exit 0

Who may talk: every spawn of a worker gets two fresh random values in its spawn arguments
(never its environment or command line): the routing identity its DEALER connects with,
and a secret its `hello` carries. The supervisor accepts nothing from a routing identity
it did not hand out, and nothing but a `hello` with the right secret until that hello.
Without ROUTER_HANDOVER nobody can take over a connected identity. The name
`w<slot>.<generation>` is for logs and status only. Everything a peer names (event types,
MCP states, outcomes) is checked against the vocabulary (`supervisor.core.vocabulary`), so
no peer can create a metric series.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from supervisor.contract.clock import SYSTEM
from supervisor.contract.limits import MAX_NAME as MAX_NAME
from supervisor.contract.limits import MAX_SERVERS as MAX_SERVERS
from supervisor.contract.limits import PRINTABLE
from supervisor.core.traces import parse_traceparent
from supervisor.core.vocabulary import (
    MCP_REPORTED,
    AssignReason,
    Cause,
    EventType,
)

# Upper bounds (seconds) of the append latency histogram, shared by workers and supervisor.
APPEND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

MAX_FRAME = 64 * 1024  # bytes; a peer that sends a bigger frame is disconnected by zmq
MAX_SEQ = 2**62  # beyond any seq or lease token, and within every backend's BIGINT
MAX_COUNT = 1_000_000  # sessions, turns, observations per heartbeat
MAX_ASSIGN = 500  # sessions in one `assign`: 500 fit in a `MAX_FRAME`; a pass assigns fewer
# Live output: a worker sends at most one `delta` a turn per DELTA_INTERVAL seconds, each
# with at most MAX_DELTA characters (more text waiting is sent in the next ones).
DELTA_INTERVAL = 0.05
MAX_DELTA = 8192  # characters; 4 bytes each at most in UTF-8, escaped: within MAX_FRAME


class Histogram:
    """Observations since the last `take`: counts per bucket (the last is +Inf) and sum.

    Workers send these as deltas in their heartbeats; the supervisor adds them up.
    """

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._reset()

    def _reset(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.sum += value

    def take(self) -> dict[str, Any]:
        """The delta since the last take, as a JSON-able dict; starts a new one."""
        delta = {"counts": self.counts, "sum": self.sum}
        self._reset()
        return delta


class ProtocolError(ValueError):
    """A frame that is not a message of the control plane; the text says why."""


# --- the schema ---------------------------------------------------------------------


def _one_of(words: Iterable[str]) -> AfterValidator:
    allowed = frozenset(words)
    listed = ", ".join(sorted(allowed))

    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"should be one of {listed}")
        return value

    return AfterValidator(check)


Id = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]  # sessions, turns
Secret = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
WorkerName = Annotated[str, StringConstraints(pattern=r"^w[0-9]{1,6}\.[0-9]{1,12}$")]
Seq = Annotated[int, Field(ge=1, le=MAX_SEQ)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Total = Annotated[int, Field(ge=0, le=MAX_SEQ)]  # grows for as long as a worker lives
ModelErrorKind = Literal["transient", "permanent"]  # `workers.models.ModelError.transient`
# A name shown to the operator (status, tables): printable, no control characters.
ServerName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME, pattern=PRINTABLE)]
Word = StringConstraints(max_length=40)
# Strings checked against the vocabulary (a strict model takes no str for an enum field).
EventTypeWord = Annotated[str, Word, _one_of(EventType)]
McpStateWord = Annotated[str, Word, _one_of(MCP_REPORTED)]
ReasonWord = Annotated[str, Word, _one_of(AssignReason)]
CauseWord = Annotated[str, Word, _one_of(Cause)]
# Trace context from the other side: a value that is no traceparent is None, never an
# error (tracing must not stop a turn).
TraceParent = Annotated[
    str | None, BeforeValidator(lambda value: value if parse_traceparent(value) else None)
]
Attempt = Annotated[int, Field(ge=1, le=1_000_000)]


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _FromWorker(_Message):
    worker: WorkerName


class Hello(_FromWorker):
    type: Literal["hello"] = "hello"
    pid: Annotated[int, Field(ge=1, le=2**31 - 1)]
    secret: Secret


class Ready(_FromWorker):
    type: Literal["ready"] = "ready"
    # Its MCP servers by name, each ready or failed its start once: a reload that started
    # the worker says which did not start.
    mcp: Annotated[dict[ServerName, McpStateWord], Field(max_length=MAX_SERVERS)] = {}


class Latency(_Message):
    """Append latencies since the last heartbeat (`Histogram.take`)."""

    counts: Annotated[
        list[Count],
        Field(min_length=len(APPEND_BUCKETS) + 1, max_length=len(APPEND_BUCKETS) + 1),
    ]
    sum: Annotated[float, Field(ge=0.0, le=1e9, allow_inf_nan=False)]


class Heartbeat(_FromWorker):
    type: Literal["heartbeat"] = "heartbeat"
    sessions: Count
    turns: Count  # in flight
    turns_served: Total  # ended since the worker started
    mcp: Annotated[dict[ServerName, McpStateWord], Field(max_length=MAX_SERVERS)]  # by name
    append_latency: Latency
    # Since when the model has not answered this worker's turns (an outage), else None.
    model_down_since: Annotated[float | None, Field(ge=0.0, le=1e11, allow_inf_nan=False)] = None
    # Tokens the model's answers cost since the last heartbeat, by kind (prompt, completion).
    model_tokens: Annotated[dict[Literal["prompt", "completion"], Total], Field(max_length=2)] = {}
    # Model calls that failed since the last heartbeat: transient (timeout, refused, 429,
    # 5xx: waited out as an outage) or permanent (another 4xx, a malformed answer).
    model_errors: Annotated[dict[ModelErrorKind, Total], Field(max_length=2)] = {}
    # It was told to drain: it starts no turn, and `turns` counts the ones still to end.
    draining: bool = False
    # Spans it could not export (queue full, collector down) since the last heartbeat.
    spans_dropped: Total = 0


class _AboutSession(_FromWorker):
    session: Id


class _ToSession(_Message):
    session: Id


class Committed(_AboutSession):
    type: Literal["committed"] = "committed"
    seq: Seq
    event_type: EventTypeWord
    # A turn's own events: which turn; a continuation also the seq of the event that
    # opened the run it continues, and the attempt it is (`supervisor.core.traces`).
    turn: Id | None = None
    follows: Seq | None = None
    attempt: Attempt | None = None


class Released(_AboutSession):
    type: Literal["released"] = "released"


class Delta(_AboutSession):
    """Live output of the turn `turn`: `text` the model streamed since the previous delta
    (may be empty), or `tool_call`, the name of a tool the model calls. `index` counts
    the turn's deltas from 0, so a reader sees a gap; `elapsed` is the seconds since the
    model call began (the time to the first delta, on index 0)."""

    type: Literal["delta"] = "delta"
    turn: Id
    index: Annotated[int, Field(ge=0, le=MAX_SEQ)]
    text: Annotated[str, StringConstraints(max_length=MAX_DELTA)] = ""
    tool_call: ServerName | None = None
    elapsed: Annotated[float, Field(ge=0.0, le=1e6, allow_inf_nan=False)] = 0.0


class LeaseLost(_AboutSession):
    type: Literal["lease_lost"] = "lease_lost"


class Assignment(_ToSession):
    """One session of an `assign`: its lease token, why, and what stopped its turn."""

    token: Seq
    reason: ReasonWord
    cause: CauseWord | None = None
    traceparent: TraceParent = None


class Assign(_Message):
    """Sessions given to one worker in one pass (a dead worker's k sessions: one message)."""

    type: Literal["assign"] = "assign"
    sessions: Annotated[list[Assignment], Field(min_length=1, max_length=MAX_ASSIGN)]


class Release(_ToSession):
    type: Literal["release"] = "release"


class Wake(_ToSession):
    type: Literal["wake"] = "wake"


class Interrupt(_ToSession):
    type: Literal["interrupt"] = "interrupt"


class Drain(_Message):
    """The daemon is draining: end the turns in flight, start none (until the next boot)."""

    type: Literal["drain"] = "drain"


class Stop(_Message):
    type: Literal["stop"] = "stop"


FromWorker = Annotated[
    Hello | Ready | Heartbeat | Committed | Released | LeaseLost | Delta,
    Field(discriminator="type"),
]
FromSupervisor = Annotated[
    Assign | Release | Wake | Interrupt | Drain | Stop, Field(discriminator="type")
]
WORKER_MESSAGES: TypeAdapter[FromWorker] = TypeAdapter(FromWorker)
SUPERVISOR_MESSAGES: TypeAdapter[FromSupervisor] = TypeAdapter(FromSupervisor)

_ALL: list[type[_Message]] = [Hello, Ready, Heartbeat, Committed, Released]
_ALL += [LeaseLost, Delta, Assign, Release, Wake, Interrupt, Drain, Stop]
_MODELS: dict[str, type[_Message]] = {m.model_fields["type"].default: m for m in _ALL}

M = TypeVar("M")


def encode(type: str, **fields: Any) -> bytes:
    """One message as its frame; ProtocolError unless it fits its schema."""
    model = _MODELS.get(type)
    if model is None:
        raise ProtocolError(f"unknown message type {printable(type)}")
    try:
        message = model.model_validate({"type": type, **fields})
    except ValidationError as exc:
        raise ProtocolError(describe(exc)) from exc
    return message.model_dump_json().encode()


def decode(frames: list[bytes], messages: TypeAdapter[M]) -> M:
    """The message in `frames` (one frame); ProtocolError, saying why, unless it fits."""
    if len(frames) != 1:
        raise ProtocolError(f"{len(frames)} frames, not one")
    try:
        return messages.validate_json(frames[0])
    except ValidationError as exc:
        raise ProtocolError(describe(exc)) from exc


def check_sender(message: FromWorker, name: str, secret: str, pid: int) -> None:
    """ProtocolError unless `message` speaks as worker `name` (and a hello proves it)."""
    if message.worker != name:
        raise ProtocolError(f"it speaks as worker {message.worker}")
    if isinstance(message, Hello):
        if not same_secret(message.secret, secret):
            raise ProtocolError("a hello with a wrong secret")
        if message.pid != pid:
            raise ProtocolError(f"a hello from pid {message.pid}, not {pid}")


def same_secret(given: str, expected: str) -> bool:
    """Compared in constant time."""
    return hmac.compare_digest(given.encode(), expected.encode())


def stranger(route: bytes, frames: list[bytes], secret_of: Callable[[str], str | None]) -> str:
    """Why frames from a routing identity no worker was spawned with are refused.

    `secret_of` gives a live worker's secret by its name (None: no such worker).
    """
    name = route.decode(errors="replace")
    if secret_of(name) is not None:
        return f"it uses worker {name}'s name as its identity (takeover)"
    try:
        message = decode(frames, WORKER_MESSAGES)
    except ProtocolError as exc:
        return f"unknown identity; {exc}"
    secret = secret_of(message.worker)
    if secret is None:
        return f"unknown identity; a {message.type} as worker {message.worker}"
    if isinstance(message, Hello) and not same_secret(message.secret, secret):
        return f"a hello as worker {message.worker} with a wrong secret"
    return f"a {message.type} as worker {message.worker} from another identity (takeover)"


def describe(exc: ValidationError) -> str:
    """What is wrong with a message, in one short printable line, without its values."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    parts = [f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}" for e in errors[:3]]
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return printable("; ".join(parts), 300)


def printable(text: str | bytes, limit: int = 64) -> str:
    """`text` (peer-supplied) made safe for one log line: escaped and cut to `limit`."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="backslashreplace")
    safe = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[: limit + 1])
    return safe if len(safe) <= limit else safe[: limit - 1] + "…"


class Refusals:
    """Which peers were refused, so that each is logged once, in bounded memory.

    The `size` latest refused peers are remembered; at most `burst` peers a `window` are
    logged, and the ones past that are only counted (a peer that makes up endless
    identities cannot flood the log).
    """

    def __init__(
        self,
        size: int = 1024,
        burst: int = 20,
        window: float = 60.0,
        clock: Callable[[], float] = SYSTEM.monotonic,
    ) -> None:
        self.size, self.burst, self.window, self.clock = size, burst, window, clock
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._logged: list[float] = []
        self.unlogged = 0  # peers refused without a log line since the last logged one

    def seen(self, peer: bytes) -> bool:
        """True if `peer` was refused already (as far as memory goes)."""
        if peer in self._seen:
            self._seen.move_to_end(peer)
            return True
        return False

    def first(self, peer: bytes) -> int | None:
        """Note a refusal of `peer`. None: do not log it; else log it, with that many
        peers refused unlogged since the last line."""
        if self.seen(peer):
            return None
        self._seen[peer] = None
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        now = self.clock()
        self._logged = [t for t in self._logged if now - t < self.window]
        if len(self._logged) >= self.burst:
            self.unlogged += 1
            return None
        self._logged.append(now)
        unlogged, self.unlogged = self.unlogged, 0
        return unlogged
