"""The tables, shared by the supervisor and the workers (docs/explanation/store.md).

Times are epoch seconds as floats, portable across SQLite, PostgreSQL and MySQL. Lease
expiry is written from the database clock; `created_at`/`updated_at` are informational.
The models are bound to a database by `Store`; one store is open per process.
"""

from __future__ import annotations

import peewee

from supervisor.store.db import JSON_TEXT

ID_LEN = 64
HOST_ID_LEN = 40  # a lease owner is "<host_id>/<boot>/<worker>" within ID_LEN
TARGET_LEN = 40  # a delivery target's name
PRINCIPAL_LEN = 100


class JSONTextField(peewee.TextField):
    """JSON stored as text: TEXT on SQLite and PostgreSQL, LONGTEXT on MySQL."""

    field_type = JSON_TEXT


class BaseModel(peewee.Model):
    class Meta:
        database = None
        legacy_table_names = False


class SchemaVersion(BaseModel):
    """One row: the schema version this database was migrated to."""

    id = peewee.IntegerField(primary_key=True)
    version = peewee.IntegerField()
    updated_at = peewee.DoubleField()

    class Meta:
        table_name = "schema_version"


class Session(BaseModel):
    """A conversation with an agent, and who may write it right now (the lease)."""

    id = peewee.CharField(max_length=ID_LEN, primary_key=True)
    kind = peewee.CharField(max_length=16)
    parent = peewee.CharField(max_length=ID_LEN, null=True)
    title = peewee.CharField(max_length=200, default="")
    agent = peewee.CharField(max_length=200, default="")
    status = peewee.CharField(max_length=16, default="open")
    created_at = peewee.DoubleField()
    updated_at = peewee.DoubleField()
    last_seq = peewee.BigIntegerField(default=0)
    # Lease: the token grows on every acquisition and is never reused (fencing).
    owner = peewee.CharField(max_length=ID_LEN, null=True, index=True)  # renewal finds its own
    lease_token = peewee.BigIntegerField(default=0)
    lease_expires_at = peewee.DoubleField(null=True)
    # Set by a `user_message`, cleared by the `turn_started` that will read it: the
    # session needs a turn. Kept by the event log in the same commit as the event.
    pending = peewee.BooleanField(default=False, index=True)
    # A turn in flight, set by `turn_started` and cleared by `turn_ended` in the same commit.
    active_turn_id = peewee.CharField(max_length=ID_LEN, null=True, index=True)
    # Turn attempts, charged before the turn runs (its first by `turn_started`, each
    # continuation by recovery, or by its worker going on after a cut answer or a model
    # error that may pass) and cleared by `turn_ended`.
    attempt_turn_id = peewee.CharField(max_length=ID_LEN, null=True)
    attempt_count = peewee.IntegerField(default=0)
    quarantined_at = peewee.DoubleField(null=True)
    quarantine_reason = peewee.TextField(null=True)
    # Recovery ended a turn it could not continue and asked the user to resend (a
    # `notice`); cleared by the user's next message.
    resend_requested_at = peewee.DoubleField(null=True)
    # The delivery target the session is bound to, and what it is sent (`DeliveryKind`s,
    # space-separated), as the target's configuration said: read by every append under
    # its lock, so a delivery is written in the transaction of its event.
    deliver_to = peewee.CharField(max_length=TARGET_LEN, null=True)
    deliver_kinds = peewee.CharField(max_length=200, default="")
    # The principal the session belongs to, for its limits: who created it (a subagent:
    # its root's creator; a scheduled session: the schedule's owner). Unlike the ACL it
    # never changes, so no grant can make a session count as another's.
    principal = peewee.CharField(max_length=PRINCIPAL_LEN, null=True)

    class Meta:
        table_name = "session"
        # The work query: pending sessions in the order they waited, read off the index.
        # The second counts a principal's open sessions.
        indexes = (
            (("pending", "status", "updated_at"), False),
            (("principal", "status"), False),
        )


class Event(BaseModel):
    """One committed step of a session; `seq` is contiguous from 1 per session.

    Rows are stored in append order (rowid) with a unique (session, seq) index: a group
    commit then writes few table pages, where a table clustered by session would dirty a
    page per session in the batch.
    """

    id = peewee.BigAutoField()
    # No foreign key: the append path reads the session row under the write lock before
    # it inserts, so a per-row constraint check would only repeat that, on every event.
    session_id = peewee.CharField(max_length=ID_LEN)
    seq = peewee.BigIntegerField()
    type = peewee.CharField(max_length=32)
    turn_id = peewee.CharField(max_length=ID_LEN, null=True)
    payload = JSONTextField()
    created_at = peewee.DoubleField()
    writer = peewee.CharField(max_length=16)
    lease_token = peewee.BigIntegerField(null=True)

    class Meta:
        table_name = "event"
        indexes = ((("session_id", "seq"), True),)


class IntakeKey(BaseModel):
    """The idempotency key of an intake append, and the seq it got.

    Kept apart from `event` so that the appends which carry no key (all a worker writes)
    do not pay for an index of keys.
    """

    session_id = peewee.CharField(max_length=ID_LEN)
    key = peewee.CharField(max_length=200)  # `scoped_key(principal, key)` for intake
    seq = peewee.BigIntegerField()
    digest = peewee.CharField(max_length=64, null=True)  # `request_digest` of the first request

    class Meta:
        table_name = "intake_key"
        primary_key = peewee.CompositeKey("session_id", "key")
        without_rowid = True


class SessionACL(BaseModel):
    """A principal's permission on a session: read, write or admin."""

    session = peewee.ForeignKeyField(Session, column_name="session_id", on_delete="CASCADE")
    principal = peewee.CharField(max_length=PRINCIPAL_LEN)
    permission = peewee.CharField(max_length=8)

    class Meta:
        table_name = "session_acl"
        primary_key = peewee.CompositeKey("session", "principal")


class AgentBootLog(BaseModel):
    """One row per daemon start; a row that never ended marks an unclean stop."""

    boot_id = peewee.CharField(max_length=ID_LEN, primary_key=True)
    host = peewee.CharField(max_length=255)
    pid = peewee.IntegerField()
    version = peewee.CharField(max_length=32)
    started_at = peewee.DoubleField(index=True)
    ended_at = peewee.DoubleField(null=True)
    outcome = peewee.CharField(max_length=16, null=True)
    attempted = JSONTextField(default="[]")
    breaker = JSONTextField(null=True)

    class Meta:
        table_name = "agent_boot_log"


class Host(BaseModel):
    """One daemon on the database, under its `daemon.host_id`, and whether it is alive.

    The row is renewed on the database clock; one whose `expires_at` has passed is a lost
    host, whose sessions the other daemons adopt. `boot_id` is the daemon holding the id
    now: a renewal by any other boot fails (a duplicate id, or a host that came back after
    another daemon took its id over).
    """

    host_id = peewee.CharField(max_length=HOST_ID_LEN, primary_key=True)
    boot_id = peewee.CharField(max_length=ID_LEN)
    hostname = peewee.CharField(max_length=255)
    machine = peewee.CharField(max_length=ID_LEN, default="")  # /etc/machine-id, if any
    pid = peewee.IntegerField()
    pid_started = peewee.DoubleField()  # the daemon's create_time: pid reuse is no match
    version = peewee.CharField(max_length=32)
    started_at = peewee.DoubleField()
    last_seen = peewee.DoubleField()
    expires_at = peewee.DoubleField()
    left_at = peewee.DoubleField(null=True)  # a clean stop said goodbye

    class Meta:
        table_name = "host"


class Subagent(BaseModel):
    """The registry of subagents: one row per child session a turn started, and where it is.

    Written with the parent's `subagent_spawned` and the child session, in one transaction;
    its final state is set with the parent's `subagent_result`, in one transaction, once
    (`SubagentStatus`). A daemon reconciling it holds a claim (`claimed_by`, its host and
    boot, until `claim_expires_at` by the database clock); a claim not renewed is free again.
    """

    id = peewee.CharField(max_length=ID_LEN, primary_key=True)  # the child session's id
    parent = peewee.CharField(max_length=ID_LEN)
    depth = peewee.IntegerField()  # 1 for a child of a top session, 2 for a grandchild ...
    task = peewee.TextField()
    title = peewee.CharField(max_length=200, default="")
    agent = peewee.CharField(max_length=200, default="")
    status = peewee.CharField(max_length=16, default="running", index=True)
    call_id = peewee.CharField(max_length=200, null=True)  # the tool call that spawned it
    turn_id = peewee.CharField(max_length=ID_LEN, null=True)  # the parent's turn that did
    spawned_seq = peewee.BigIntegerField()  # the parent's `subagent_spawned`
    result_seq = peewee.BigIntegerField(null=True)  # the parent's `subagent_result`
    summary = peewee.TextField(default="")  # the result, or why there is none (shortened)
    created_at = peewee.DoubleField()
    ended_at = peewee.DoubleField(null=True)
    claimed_by = peewee.CharField(max_length=ID_LEN, null=True)  # "<host>/<boot8>"
    claim_expires_at = peewee.DoubleField(null=True)
    root = peewee.CharField(max_length=ID_LEN, null=True)  # the top session of its tree

    class Meta:
        table_name = "subagent"
        indexes = ((("parent", "status"), False), (("root", "status"), False))


class Task(BaseModel):
    """The registry of background tasks: one row per task a turn started, and where it is.

    Written with the session's `task_started`, in one transaction (status `pending`); a
    daemon claims it and starts its runner (`running`, `runner_pid`, `heartbeat_at` renewed
    by the runner on the database clock). The runner records the outcome itself (`status`,
    `exit_code`, `duration`, `output_tail`); the session's `task_result` is written once,
    with `result_seq`, in the transaction that reports it (`TaskStatus`).
    """

    id = peewee.CharField(max_length=ID_LEN, primary_key=True)
    session = peewee.CharField(max_length=ID_LEN, index=True)
    principal = peewee.CharField(max_length=PRINCIPAL_LEN, null=True)  # its session's
    kind = peewee.CharField(max_length=64)
    args = JSONTextField(default="{}")  # the validated arguments
    status = peewee.CharField(max_length=16, default="pending", index=True)
    call_id = peewee.CharField(max_length=200, null=True)  # the tool call that started it
    turn_id = peewee.CharField(max_length=ID_LEN, null=True)  # the session's turn that did
    started_seq = peewee.BigIntegerField()  # the session's `task_started`
    result_seq = peewee.BigIntegerField(null=True)  # the session's `task_result`
    attempt = peewee.IntegerField(default=1)  # 2 for its one retry after a restart
    host = peewee.CharField(max_length=HOST_ID_LEN, null=True)  # where its runner runs
    runner_pid = peewee.IntegerField(null=True)
    runner_started = peewee.DoubleField(null=True)  # the runner's create_time (pid reuse)
    exit_code = peewee.IntegerField(null=True)
    duration = peewee.DoubleField(null=True)
    output_tail = peewee.TextField(default="")
    reason = peewee.TextField(default="")  # why it failed or was lost, in words
    cancel_requested = peewee.BooleanField(default=False)
    created_at = peewee.DoubleField()
    started_at = peewee.DoubleField(null=True)
    heartbeat_at = peewee.DoubleField(null=True)
    ended_at = peewee.DoubleField(null=True)
    claimed_by = peewee.CharField(max_length=ID_LEN, null=True)  # "<host>/<boot8>"
    claim_expires_at = peewee.DoubleField(null=True)

    class Meta:
        table_name = "task"
        # The second counts what runs, in all and of one principal, at each claim.
        indexes = ((("session", "turn_id", "call_id"), False), (("status", "principal"), False))


class Schedule(BaseModel):
    """A cron schedule that injects `text` into a session (or a new one per fire)."""

    id = peewee.CharField(max_length=ID_LEN, primary_key=True)
    cron = peewee.CharField(max_length=200)
    timezone = peewee.CharField(max_length=64, default="UTC")
    text = peewee.TextField()
    session = peewee.CharField(max_length=ID_LEN, null=True)  # None: a new session each fire
    owner = peewee.CharField(max_length=200, null=True)  # the principal that created it
    misfire = peewee.CharField(max_length=16, default="run_once")
    created_at = peewee.DoubleField()
    armed_from = peewee.DoubleField()  # no fire for a time before this (its creation)
    status = peewee.CharField(max_length=16, default="active")  # `ScheduleStatus`

    class Meta:
        table_name = "schedule"


class ScheduleFire(BaseModel):
    """One scheduled time of a schedule, committed before its message is injected.

    Unique on (schedule, scheduled_for): a time fires once across crashes, restarts and
    daemons. `seq` is set once the message is in its session; `reason` says why a fire's
    message is not injected (skipped, its session closed): a fire with neither is owed.
    """

    id = peewee.BigAutoField()
    schedule = peewee.CharField(max_length=ID_LEN)
    scheduled_for = peewee.DoubleField()  # epoch seconds
    outcome = peewee.CharField(max_length=16)  # `FireOutcome`
    session = peewee.CharField(max_length=ID_LEN, null=True)
    seq = peewee.BigIntegerField(null=True)
    fired_at = peewee.DoubleField()
    fired_by = peewee.CharField(max_length=ID_LEN, default="")  # "<host>/<boot8>"
    reason = peewee.TextField(default="")

    class Meta:
        table_name = "schedule_fire"
        indexes = ((("schedule", "scheduled_for"), True),)


class Delivery(BaseModel):
    """One event of a session to push to a target: the outbox (`DeliveryStatus`).

    Written by the append of its event, in the same transaction (`next_at` 0: due at
    once). A daemon claims it (`claimed_by`, `claim_expires_at` on the database clock)
    while it is sent; each failed attempt counts in `attempts` and moves `next_at` by the
    backoff. Unique on (session, seq, target): an event goes to a target once.
    """

    id = peewee.CharField(max_length=ID_LEN, primary_key=True)  # the Idempotency-Key
    target = peewee.CharField(max_length=TARGET_LEN)
    session = peewee.CharField(max_length=ID_LEN)
    seq = peewee.BigIntegerField()
    kind = peewee.CharField(max_length=32)  # `DeliveryKind`
    status = peewee.CharField(max_length=16, default="pending")
    attempts = peewee.IntegerField(default=0)
    next_at = peewee.DoubleField(default=0.0)  # database clock; 0: at once
    created_at = peewee.DoubleField()  # its event's
    claimed_by = peewee.CharField(max_length=ID_LEN, null=True)  # "<host>/<boot8>"
    claim_expires_at = peewee.DoubleField(null=True)
    last_code = peewee.IntegerField(null=True)  # the last attempt's HTTP status, if any
    last_error = peewee.TextField(default="")  # what the last failed attempt met, in words
    delivered_at = peewee.DoubleField(null=True)
    updated_at = peewee.DoubleField()

    class Meta:
        table_name = "delivery"
        indexes = (
            (("session", "seq", "target"), True),
            (("status", "target", "next_at"), False),
            # The claim's "no earlier pending row of its session": a probe, whatever the
            # session's delivered history.
            (("session", "target", "status", "seq"), False),
        )


class RestartRequest(BaseModel):
    """A restart request (`RestartState`), written before anything stops; settled once by
    the boot after the stop. `active_host` is the host while it is live, NULL once done:
    its unique index keeps one live request per host. Times: the database clock."""

    id = peewee.CharField(max_length=32, primary_key=True)  # uuid4 hex
    host = peewee.CharField(max_length=HOST_ID_LEN)
    boot = peewee.CharField(max_length=ID_LEN)  # the boot whose stop it is
    pid = peewee.IntegerField()  # that boot's daemon
    session = peewee.CharField(max_length=ID_LEN, null=True)  # None: an operator's request
    turn_id = peewee.CharField(max_length=ID_LEN, null=True)
    call_id = peewee.CharField(max_length=200, null=True)  # with session: a repeated call
    requested_by = peewee.CharField(max_length=100)  # a principal, or "agent"
    reason = peewee.TextField(default="")
    drain = peewee.DoubleField(null=True)  # seconds; None: shutdown.drain_budget
    state = peewee.CharField(max_length=16, default="pending")
    active_host = peewee.CharField(max_length=HOST_ID_LEN, null=True, unique=True)
    requested_at = peewee.DoubleField()
    started_at = peewee.DoubleField(null=True)
    settled_at = peewee.DoubleField(null=True)
    version_before = peewee.CharField(max_length=32)
    config_before = peewee.CharField(max_length=64)
    outcome = peewee.CharField(max_length=16, null=True)  # `RestartOutcome`
    detail = peewee.TextField(default="")
    boot_after = peewee.CharField(max_length=ID_LEN, null=True)
    version_after = peewee.CharField(max_length=32, null=True)
    config_after = peewee.CharField(max_length=64, null=True)
    seconds = peewee.DoubleField(null=True)  # from started_at (else requested_at) to settled
    request_seq = peewee.BigIntegerField(null=True)  # the session's `restart_requested`
    notice_seq = peewee.BigIntegerField(null=True)
    result_seq = peewee.BigIntegerField(null=True)  # the session's `restart_result`

    class Meta:
        table_name = "restart_request"
        indexes = ((("host", "requested_at"), False),)


class ChildProcess(BaseModel):
    """A live worker or MCP child, identified safely against pid reuse by create_time."""

    id = peewee.BigAutoField()
    boot = peewee.CharField(max_length=ID_LEN, index=True)
    host = peewee.CharField(max_length=HOST_ID_LEN, default="", index=True)  # its daemon's
    pid = peewee.IntegerField()
    create_time = peewee.DoubleField()
    pgid = peewee.IntegerField(null=True)
    kind = peewee.CharField(max_length=16)
    worker = peewee.CharField(max_length=ID_LEN, null=True)
    name = peewee.CharField(max_length=200, default="")
    started_at = peewee.DoubleField()

    class Meta:
        table_name = "child_process"


MODELS: list[type[BaseModel]] = [
    SchemaVersion,
    Session,
    Event,
    IntakeKey,
    SessionACL,
    AgentBootLog,
    Host,
    Subagent,
    Task,
    Schedule,
    ScheduleFire,
    Delivery,
    RestartRequest,
    ChildProcess,
]
