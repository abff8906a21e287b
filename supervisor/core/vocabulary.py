"""turnkeeper's vocabulary: every fixed set of words the daemon stores, sends or counts.

Each set is a `StrEnum` whose values are the strings on the wire, in the database and in
metric labels, so a member compares equal to its string and serializes as it. Imported by
every layer; imports nothing but the standard library.

Glossary (one word per concept; the words after "not" are not used for it)
---------------------------------------------------------------------------
session        a conversation with an agent, its event log and its lease.
event          one committed entry of a session's log (`EventType`); its `seq` orders it.
user message   the text a client adds to a session (event `user_message`).
inject         what a client does to add a user message (`POST /v1/sessions/{id}/inject`,
               `turnkeeper inject`); not send, input or post.
intake         the side of the daemon that takes requests in and commits them before it
               answers (log subsystem, event writer, `turnkeeper_intake_rejections`).
pending        a session whose committed input has not been read by a turn yet; not
               queued or waiting.
turn           one run of the agent over a session's pending input, from `turn_started`
               to `turn_ended` (`TurnOutcome`).
wake           a signal that a session may have work: re-read it (control message `wake`,
               `POST /wake`); not kick, poke or nudge.
continuation   going on with a turn a previous owner left unfinished, or that its own
               worker saw cut by the token limit or failed by a model error that may
               pass; its note names the `Cause` and the attempt. Not resume or retry.
worker         one worker process (`w<slot>.<generation>`); not child or process.
slot           a place in the pool that one worker generation after another fills
               (`SlotState`).
agent          the user's code a worker runs for a turn; not bot or assistant.
assign         the supervisor handing a session to a worker, with an `AssignReason`.
lease          a worker's fenced right to write a session's events; its token fences.
boot           one start of the daemon, from its row in the boot log to its `BootOutcome`.
backoff        the wait before a crashed slot's worker or MCP server is started again
               (`supervisor.core.backoff`).
quarantine     stopping a session whose turns keep killing workers; lifted by release.
MCP server     a tool server a worker runs as its child (`McpState`).
principal      who a bearer token speaks for; its `Permission` on a session.
subagent       a session another session's turn started for a task (its `parent`), run
               like any session, whose outcome goes back to the parent once
               (`SubagentStatus`); not child session or sub-task.
task           a background command of an operator-defined kind (`[[tasks.kinds]]`) a turn
               started (`task_started`); its runner records its outcome and the session
               gets it once (`task_result`, `TaskStatus`); not job or background turn.
schedule       a cron expression that injects a message into a session on time.
fire           one scheduled time of a schedule, committed once before its message is
               injected (`FireOutcome`); not trigger or tick.
delivery       one committed event of a session pushed to an operator-configured target
               (`[[delivery.targets]]`) as a signed POST, written with its event
               (`DeliveryStatus`); not webhook call or notification.
target         where deliveries go: a name, a URL and a secret of the configuration.
reload         the daemon reading its configuration again and applying what may change
               live (`SIGHUP`, `turnkeeper reload`); not refresh or re-read.
restart        the daemon stopping and starting again in place, asked for by an operator
               or an agent (`RestartState`); the request is a row committed first, and its
               outcome goes to the session that asked, once (`restart_result`).
"""

from __future__ import annotations

from enum import StrEnum


class EventType(StrEnum):
    """What an event of the log records."""

    USER_MESSAGE = "user_message"  # a client's message (intake), or an autonomous run's goal
    TURN_STARTED = "turn_started"  # a turn read the pending input up to `read_to`
    MODEL_RESPONSE = "model_response"  # one answer of the model, with its tool calls
    TOOL_CALL = "tool_call"  # a tool call is about to run
    TOOL_RESULT = "tool_result"  # what it returned
    TURN_ENDED = "turn_ended"  # the turn is over, with its `TurnOutcome`
    CONTINUATION = "continuation"  # a turn goes on after an interruption, a cut or an error
    CHECKPOINT = "checkpoint"  # an autonomous run's progress and budgets
    NOTICE = "notice"  # the daemon tells the user something (quarantine, resend)
    ACL = "acl"  # a principal's permission changed
    SUBAGENT_SPAWNED = "subagent_spawned"  # a turn started a subagent (a child session)
    SUBAGENT_RESULT = "subagent_result"  # a subagent's run ended: its outcome, for the parent
    TASK_STARTED = "task_started"  # a turn started a background task (its registry row)
    TASK_RESULT = "task_result"  # a task's outcome (or that it was lost), for its session
    RESTART_REQUESTED = "restart_requested"  # a turn asked for a restart (its registry row)
    RESTART_RESULT = "restart_result"  # the restart a turn asked for happened (or not)
    COMPACTION = "compaction"  # the older conversation replaced by a summary (workers.context)


TURN_EVENTS = frozenset({EventType.TURN_STARTED, EventType.TURN_ENDED, EventType.CONTINUATION})
"""Events that belong to a turn: they need a turn id."""

INPUT_EVENTS = frozenset(
    {
        EventType.USER_MESSAGE,
        EventType.SUBAGENT_RESULT,
        EventType.TASK_RESULT,
        EventType.RESTART_RESULT,
    }
)
"""Events a turn answers: they mark their session pending until a turn reads them."""


class Writer(StrEnum):
    """Who appended an event."""

    WORKER = "worker"  # the worker holding the session's lease
    INTAKE = "intake"  # the HTTP API, for a client
    SUPERVISOR = "supervisor"  # recovery, quarantine, ACL changes
    CLI = "cli"  # an operator's command on the database


class TurnOutcome(StrEnum):
    """How a turn ended (`turn_ended`'s outcome)."""

    COMPLETED = "completed"  # the agent answered
    TRUNCATED = "truncated"  # the model's answer was cut off by its token limit
    FAILED = "failed"  # an error, or recovery gave up on it
    INTERRUPTED = "interrupted"  # its worker stopped it (release, lease lost)
    INTERRUPTED_BY_OPERATOR = "interrupted_by_operator"  # `POST /interrupt`; never continued
    BUDGET_EXHAUSTED = "budget_exhausted"  # its next model call would pass a token budget


class BootOutcome(StrEnum):
    """How a boot of the daemon ended (None in the boot log: it never ended)."""

    CLEAN = "clean"  # stopped on request, everything released
    UNCLEAN = "unclean"  # stopped, but something was left behind
    STARTUP_FAILED = "startup_failed"  # it never became ready


class SessionKind(StrEnum):
    """Who drives a session."""

    ATTACHED = "attached"  # a client that reads its answers
    CHANNEL = "channel"  # a chat channel bridged to the session
    AUTONOMOUS = "autonomous"  # a run that goes on by itself towards a goal
    SUBAGENT = "subagent"  # started by another session (its `parent`)
    SCHEDULED = "scheduled"  # made by a schedule's fire (`session: null`); never recovered


class SessionStatus(StrEnum):
    """Whether a session takes turns."""

    OPEN = "open"
    QUARANTINED = "quarantined"  # its turns kept killing workers; an operator releases it
    CLOSED = "closed"


class SubagentStatus(StrEnum):
    """Where a subagent is (the `subagent` registry); every state but RUNNING is final and
    was reported to the parent, once, in the transaction that set it."""

    RUNNING = "running"  # its session has work or a turn in flight; no result yet
    COMPLETED = "completed"  # its run ended with an answer
    FAILED = "failed"  # its run ended in an error, or could not be continued safely
    CANCELLED = "cancelled"  # its parent was interrupted (`POST /interrupt`) or closed
    FINALIZED = "finalized"  # interrupted longer ago than subagents.freshness: not resumed
    WEDGED = "wedged"  # its turn failed subagents.max_recoveries times: never picked again

    @property
    def final(self) -> bool:
        """True for every state but RUNNING."""
        return self is not SubagentStatus.RUNNING


class TaskStatus(StrEnum):
    """Where a background task is (the `task` registry). PENDING and RUNNING are live; every
    other state is its outcome, reported to its session once (`task_result`)."""

    PENDING = "pending"  # admitted with its `task_started`; no runner started yet
    RUNNING = "running"  # its runner runs the command and renews `heartbeat_at`
    SUCCEEDED = "succeeded"  # the command exited 0
    FAILED = "failed"  # the command exited non-zero, was killed, or could not start
    TIMED_OUT = "timed_out"  # it ran past its kind's `timeout` and was stopped
    CANCELLED = "cancelled"  # `DELETE /v1/tasks/{id}` (or its session closed) stopped it
    LOST = "lost"  # its runner went away with no outcome (a restart): tasks.lost_grace passed

    @property
    def final(self) -> bool:
        """True for an outcome: neither PENDING nor RUNNING."""
        return self not in (TaskStatus.PENDING, TaskStatus.RUNNING)


class TaskAction(StrEnum):
    """What a reconcile pass did with a task (`turnkeeper_task_reconcile_total{action}`)."""

    START = "start"  # a pending task got its runner
    REPORT = "report"  # an outcome recorded but not reported was reported
    LOST = "lost"  # its runner was gone with no outcome: lost, and the session told
    RETRY = "retry"  # the same, for a kind with retry_on_restart: started again, once


class RestartState(StrEnum):
    """Where a restart request is (the `restart_request` registry). PENDING and RESTARTING
    are live (at most one per host); DONE was reported to its session once, if it has one."""

    PENDING = "pending"  # admitted; the daemon has not begun to stop for it
    RESTARTING = "restarting"  # the daemon began to stop for it (intake refuses, drain)
    DONE = "done"  # a later boot settled it: its outcome written, the session told


class RestartOutcome(StrEnum):
    """How a restart request ended (`turnkeeper_restarts_total{outcome}`)."""

    OK = "ok"  # the daemon stopped cleanly for it and came back
    FAILED = "failed"  # it did not: refused at the start, or the stop was not clean


class Misfire(StrEnum):
    """What a schedule does with the fires it missed while no daemon ran."""

    RUN_ONCE = "run_once"  # one catch-up fire for the newest missed time, within misfire_grace
    SKIP = "skip"  # none; the next fire runs on time


ADMIN_PRINCIPAL = "admin"  # the principal of the admin token (`<state_dir>/admin.token`)


class ScheduleStatus(StrEnum):
    """Whether a schedule fires."""

    ACTIVE = "active"  # fires on its times
    PAUSED = "paused"  # its owner's token was revoked: listed, never fired, until it is back
    HELD = "held"  # a user paused it (`schedules pause`): listed, never fired, until resumed
    ENDED = "ended"  # its session was closed: never fires again, counted against no limit


class FireOutcome(StrEnum):
    """How a scheduled time was handled (`turnkeeper_schedule_fires_total{outcome}`)."""

    FIRED = "fired"  # on time
    CAUGHT_UP = "caught_up"  # missed while down, run once after (misfire `run_once`)
    SKIPPED = "skipped"  # missed while down and not run (misfire `skip`, or past the grace)


class DeliveryStatus(StrEnum):
    """Where a delivery is (the `delivery` outbox). PENDING is live; the others are final
    until an operator retries a dead one."""

    PENDING = "pending"  # written with its event; sent, or sent again after the backoff
    DELIVERED = "delivered"  # its target answered 2xx
    DEAD = "dead"  # refused (4xx but 408/429), or not delivered within `delivery.max_age`
    # (or `delivery.max_attempts` attempts, if set)


class DeliveryKind(StrEnum):
    """What a target may ask to be sent (`events` of `[[delivery.targets]]`): an event type,
    or `answer`, a turn's answer to the user (a `model_response` that asks for no tool: the
    final answer, or a part cut by the token limit that a continuation goes on from)."""

    ANSWER = "answer"
    NOTICE = "notice"
    TURN_ENDED = "turn_ended"
    TASK_RESULT = "task_result"
    SUBAGENT_RESULT = "subagent_result"


class AttemptOutcome(StrEnum):
    """How one attempt at a delivery went (`turnkeeper_delivery_attempts_total{outcome}`)."""

    DELIVERED = "delivered"  # 2xx
    FAILED = "failed"  # no answer, 5xx, 408, 429...: sent again after the backoff
    DEAD = "dead"  # refused, or the last attempt failed: no more attempts


class Permission(StrEnum):
    """A principal's access to a session; each includes the ones before it."""

    READ = "read"
    WRITE = "write"
    ADMIN = "admin"

    def includes(self, needed: Permission | str) -> bool:
        """Whether holding this permission allows what `needed` allows."""
        order = list(Permission)
        return order.index(self) >= order.index(Permission(needed))


class AssignReason(StrEnum):
    """Why the supervisor assigns a session to a worker (control message `assign`)."""

    NEW = "new"  # the session has work and no owner
    ADOPT = "adopt"  # its worker died; another one takes it over
    HANDOFF = "handoff"  # its worker released it during a rolling restart
    RESTART = "restart"  # recovery continues a turn a previous boot left unfinished

    @property
    def cause(self) -> Cause:
        """What a continuation note says stopped the turn, when the assign names none."""
        return _CAUSE_OF_REASON[self]


class Cause(StrEnum):
    """What stopped a turn, as its continuation note and recovery's notices tell it."""

    WORKER_CRASH = "worker_crash"
    DAEMON_RESTART = "daemon_restart"
    HANDOFF = "handoff"
    LEASE_EXPIRED = "lease_expired"
    HOST_LOST = "host_lost"  # another daemon on the database stopped renewing its leases
    INTERRUPTED = "interrupted"
    MAX_TOKENS = "max_tokens"  # also what its own worker continues a cut answer for
    MODEL_ERROR = "model_error"  # a model call failed with an error that may pass
    STORAGE_UNAVAILABLE = "storage_unavailable"

    @property
    def text(self) -> str:
        """The cause in words, for the user."""
        return _CAUSE_TEXT[self]


_CAUSE_OF_REASON = {
    AssignReason.ADOPT: Cause.WORKER_CRASH,
    AssignReason.RESTART: Cause.DAEMON_RESTART,
    AssignReason.HANDOFF: Cause.HANDOFF,
    AssignReason.NEW: Cause.INTERRUPTED,
}
_CAUSE_TEXT = {
    Cause.WORKER_CRASH: "the worker process running it stopped unexpectedly",
    Cause.DAEMON_RESTART: "the turnkeeper daemon restarted",
    Cause.HANDOFF: "the session moved to another worker during a rolling restart",
    Cause.LEASE_EXPIRED: "the worker running it stopped responding and lost the session",
    Cause.HOST_LOST: (
        "the turnkeeper host running it stopped, or lost the database, and another host "
        "took the session over"
    ),
    Cause.INTERRUPTED: "its previous owner stopped",
    Cause.MAX_TOKENS: "the model's answer was cut off by its output token limit",
    Cause.MODEL_ERROR: (
        "the model call failed with an error that may pass (a timeout, a rate limit or a "
        "server error)"
    ),
    Cause.STORAGE_UNAVAILABLE: "the database could not be written for a while",
}


class SlotState(StrEnum):
    """Where a worker slot is in its life (`supervisor.core.slots`)."""

    STARTING = "starting"  # process started, has not reported ready
    RUNNING = "running"  # reported ready
    BACKOFF = "backoff"  # no process; waiting until restart_at to start one
    FATAL = "fatal"  # could not even start max_failed_starts times in a row; never restarted
    STOPPED = "stopped"  # stopped on request; not restarted


class McpState(StrEnum):
    """Where an MCP server is in its life (`workers.mcp`)."""

    NEW = "new"  # start() not called yet; reported as starting
    STARTING = "starting"  # spawned, initializing and listing its tools
    READY = "ready"  # answering calls
    BACKOFF = "backoff"  # died or failed to start; restarted after a delay
    DOWN = "down"  # crashed too often; unavailable until the workers restart
    STOPPED = "stopped"  # closed by the worker

    @property
    def reported(self) -> McpState:
        """The state a heartbeat reports (a server not started yet is starting)."""
        return McpState.STARTING if self is McpState.NEW else self


MCP_REPORTED = tuple(state for state in McpState if state is not McpState.NEW)
"""The MCP states heartbeats carry and the metric counts."""


class SessionCount(StrEnum):
    """The label values of `turnkeeper_sessions`: statuses, and two states of open ones."""

    OPEN = SessionStatus.OPEN.value
    RUNNING = "running"  # open, with a turn in flight
    PENDING = "pending"  # open, with input waiting for a turn
    QUARANTINED = SessionStatus.QUARANTINED.value
    CLOSED = SessionStatus.CLOSED.value


class Rejection(StrEnum):
    """Why intake refused a request (`turnkeeper_intake_rejections`)."""

    TOO_LARGE = "too_large"  # the body is over http.max_body
    STOPPING = "stopping"  # the daemon is stopping
    STORAGE_UNAVAILABLE = "storage_unavailable"  # the database takes no writes
    TOO_MANY_STREAMS = "too_many_streams"  # the principal holds its limit of attach streams
