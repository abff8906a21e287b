"""The ownership engine, driven in-process with plain data and a clock that is a number.

No processes, no sockets, no sleeps: the pool's decisions (who gets which session, whose
owner is woken, what recovery is asked to judge, in which order and how many per pass)
are checked here as tables, and as a Hypothesis state machine that kills workers, lets
leases run out and restarts the pool while sessions come in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from supervisor.contract.config import RecoveryConfig
from supervisor.core import engine
from supervisor.core.engine import (
    Assign,
    Budget,
    Command,
    Facts,
    Judge,
    Memory,
    Move,
    Next,
    SessionView,
    Step,
    Wake,
    WorkerView,
)
from supervisor.core.recovery import Action, Decision, Interruption, Trigger, decide
from supervisor.core.tail import TailClass
from supervisor.core.vocabulary import AssignReason
from tests.conftest import BACKENDS

NOW = 1_800_000_000.0  # database and wall time
MONO = 5_000.0  # the pool's monotonic time
HOST = "host/"
BOOT = "host/boot0001"
FACTS = Facts(owner_prefix=BOOT, host_prefix=HOST, heartbeat_interval=1.0)
LIVE = NOW + 30  # a lease that has not expired


def worker(name: str, **changes: Any) -> WorkerView:
    return dataclasses.replace(WorkerView(name, last_heartbeat=MONO), **changes)


def plan(
    sessions: list[SessionView],
    workers: list[WorkerView],
    *,
    assigned: dict[str, str] | None = None,
    woken: dict[str, int] | None = None,
    memory: dict[str, Memory] | None = None,
    facts: Facts = FACTS,
    busy: frozenset[str] = frozenset(),
    now: float = NOW,
) -> list[Command]:
    return engine.plan(
        sessions,
        {w.name: w for w in workers},
        assigned or {},
        woken or {},
        memory or {},
        facts,
        now=now,
        wall=now,
        monotonic=MONO,
        busy=busy,
    )


NEW = SessionView("s1", pending=True, last_seq=3)
OURS = f"{BOOT}/w0.1"  # a lease owner of this boot
INTERRUPTED = SessionView("s1", owner=OURS, lease_expires_at=NOW - 1, active_turn_id="t1")


# --- one session, one pass ---------------------------------------------------------------

CASES: list[tuple[str, dict[str, Any], list[Command]]] = [
    ("new input, free: assigned", {"sessions": [NEW]}, [Assign("s1", "w0", AssignReason.NEW)]),
    (
        "new input, owner live: woken once",
        {
            "sessions": [dataclasses.replace(NEW, owner=OURS, lease_expires_at=LIVE)],
            "assigned": {"s1": "w0"},
        },
        [Wake("s1", "w0", 3)],
    ),
    (
        "owner already told of this input: nothing",
        {
            "sessions": [dataclasses.replace(NEW, owner=OURS, lease_expires_at=LIVE)],
            "assigned": {"s1": "w0"},
            "woken": {"s1": 3},
        },
        [],
    ),
    (
        "owner stopped renewing: moved and given to the least-loaded",
        {
            "sessions": [dataclasses.replace(NEW, owner=OURS, lease_expires_at=NOW - 1)],
            "assigned": {"s1": "w0"},
            "workers": [worker("w0", sessions=1), worker("w1")],
        },
        [Move("s1", "w0", True), Assign("s1", "w1", AssignReason.NEW)],
    ),
    (
        "owner died with a turn in flight: moved, judged on the spare",
        {
            "sessions": [INTERRUPTED],
            "assigned": {"s1": "w0"},
            "workers": [worker("w0", alive=False), worker("w1"), worker("w2", spare=True)],
        },
        [Move("s1", "w0", False), Judge("s1", Trigger.WORKER_DEATH, "w2")],
    ),
    (
        "new input goes to a worker, not the spare",
        {"sessions": [NEW], "workers": [worker("w1", spare=True), worker("w2", sessions=5)]},
        [Assign("s1", "w2", AssignReason.NEW)],
    ),
    (
        "another host's live lease: that host's",
        {"sessions": [dataclasses.replace(NEW, owner="other/b/w0", lease_expires_at=LIVE)]},
        [],
    ),
    (
        "another host's lease ran out: judged as its worker's death",
        {
            "sessions": [
                dataclasses.replace(INTERRUPTED, owner="other/b/w0", lease_expires_at=NOW - 1)
            ]
        },
        [Judge("s1", Trigger.WORKER_DEATH, "w0")],
    ),
    ("being assigned right now: left alone", {"sessions": [NEW], "busy": frozenset({"s1"})}, []),
    (
        "pool stopping: nothing assigned",
        {"sessions": [NEW], "facts": dataclasses.replace(FACTS, stopping=True)},
        [],
    ),
    (
        "a worker that missed 3 heartbeats gets nothing",
        {"sessions": [NEW], "workers": [worker("w0", last_heartbeat=MONO - 3.5)]},
        [],
    ),
    (
        "retiring, stopping, aborted, replaced or unready workers get nothing",
        {
            "sessions": [NEW],
            "workers": [
                worker("w0", retiring=True),
                worker("w1", stop_requested=True),
                worker("w2", aborted=True),
                worker("w3", replacing=True),
                worker("w4", ready=False),
            ],
        },
        [],
    ),
    (
        "an earlier boot's interrupted turn nobody asked for: left to the scan",
        {"sessions": [dataclasses.replace(INTERRUPTED, owner="host/oldboot1/w0.1")]},
        [],
    ),
    (
        "picked by the boot scan: judged",
        {
            "sessions": [dataclasses.replace(INTERRUPTED, owner="host/oldboot1/w0.1")],
            "memory": {"s1": Memory(picked=Trigger.BOOT_SCAN)},
        },
        [Judge("s1", Trigger.BOOT_SCAN, "w0")],
    ),
    (
        "touched by a request: judged as a first touch",
        {
            "sessions": [dataclasses.replace(INTERRUPTED, owner=None)],
            "memory": {"s1": Memory(touched=True)},
        },
        [Judge("s1", Trigger.FIRST_TOUCH, "w0")],
    ),
    (
        "a queued user message on an interrupted turn: judged at once",
        {"sessions": [dataclasses.replace(INTERRUPTED, pending=True)]},
        [Judge("s1", Trigger.USER_MESSAGE, "w0")],
    ),
    (
        "next attempt not due: not judged",
        {"sessions": [INTERRUPTED], "memory": {"s1": Memory(due=NOW + 5)}},
        [],
    ),
    (
        "next attempt due: judged",
        {"sessions": [INTERRUPTED], "memory": {"s1": Memory(due=NOW)}},
        [Judge("s1", Trigger.WORKER_DEATH, "w0")],
    ),
    (
        "judged SKIP (quarantine pending, say) and nothing changed: not judged again",
        {
            "sessions": [INTERRUPTED],
            "memory": {
                "s1": Memory(settled=engine.settled_key(INTERRUPTED, Trigger.WORKER_DEATH, False))
            },
        },
        [],
    ),
    (
        "judged SKIP but the breaker cleared since: judged again",
        {
            "sessions": [INTERRUPTED],
            "memory": {
                "s1": Memory(settled=engine.settled_key(INTERRUPTED, Trigger.WORKER_DEATH, True))
            },
        },
        [Judge("s1", Trigger.WORKER_DEATH, "w0")],
    ),
]


@pytest.mark.parametrize(("given", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_one_session(given: dict[str, Any], expected: list[Command]) -> None:
    given = {"workers": [worker("w0")], **given}
    assert plan(given.pop("sessions"), given.pop("workers"), **given) == expected


# --- fairness and budgets ------------------------------------------------------------------


def backlog(n: int) -> list[SessionView]:
    """`n` turns interrupted by this boot's workers' deaths, oldest first."""
    return [
        SessionView(f"old{i:05}", owner=OURS, lease_expires_at=NOW - 60, active_turn_id=f"t{i}")
        for i in range(n)
    ]


def test_a_new_session_is_planned_first_while_1500_interrupted_sessions_wait() -> None:
    # The store returns pending input first (Sessions.with_work); even in the worst
    # order, with the new session last, the engine plans it before any recovery.
    sessions = [*backlog(1_500), SessionView("new", pending=True, last_seq=1)]
    commands = plan(sessions, [worker("w0"), worker("w1"), worker("w2", spare=True)])
    assert commands[0] == Assign("new", "w0", AssignReason.NEW)
    judged = [c for c in commands if isinstance(c, Judge)]
    assert len(judged) == FACTS.budget.judge  # the backlog goes on over later passes
    assert len(commands) == 1 + FACTS.budget.judge


def test_the_backlog_is_worked_off_over_passes_oldest_first() -> None:
    sessions = backlog(45)
    seen: list[str] = []
    memory: dict[str, Memory] = {}
    for _ in range(3):
        commands = plan(sessions, [worker("w0")], memory=memory)
        seen += [c.session for c in commands]
        # What recovery would do: charge and continue (taken out of the backlog here).
        sessions = [s for s in sessions if s.id not in {c.session for c in commands}]
    assert seen == [s.id for s in backlog(45)]


def test_assignments_per_pass_are_bounded_and_spread_over_the_workers() -> None:
    news = [SessionView(f"n{i}", pending=True, last_seq=1) for i in range(100)]
    budget = Budget(assign=9, judge=1)
    commands = plan(
        news,
        [worker("w0", sessions=2), worker("w1"), worker("w2")],
        facts=dataclasses.replace(FACTS, budget=budget),
    )
    assert [c.session for c in commands] == [f"n{i}" for i in range(9)]
    loads = {name: sum(1 for c in commands if c.worker == name) for name in ("w0", "w1", "w2")}
    assert loads == {"w0": 2, "w1": 4, "w2": 3}  # w0 already had 2: all end with 4 or so


def test_a_queued_user_message_on_an_interrupted_turn_beats_the_backlog() -> None:
    queued = SessionView(
        "q", owner=OURS, lease_expires_at=NOW - 1, active_turn_id="t", pending=True
    )
    commands = plan([*backlog(50), queued], [worker("w0")])
    assert commands[0] == Judge("q", Trigger.USER_MESSAGE, "w0")


# --- worker death with k sessions, lease expiry, quarantine -----------------------------


@pytest.mark.parametrize("k", [1, 3, 25, 150])
def test_worker_death_with_k_sessions_moves_each_and_the_spare_takes_them_all(k: int) -> None:
    sessions = [
        SessionView(f"s{i}", owner=f"{BOOT}/w0.1", lease_expires_at=LIVE, active_turn_id=f"t{i}")
        for i in range(k)
    ]
    workers = [worker("w0", alive=False), worker("w1", sessions=4), worker("w2", spare=True)]
    commands = plan(sessions, workers, assigned={s.id: "w0" for s in sessions})
    moves = [c for c in commands if isinstance(c, Move)]
    judged = [c for c in commands if isinstance(c, Judge)]
    assert [m.session for m in moves] == [s.id for s in sessions]
    assert all(j.trigger is Trigger.WORKER_DEATH for j in judged)
    assert len(judged) == min(k, FACTS.budget.judge)
    # The spare is there for them: it takes every one, so they go over in one message.
    assert {j.worker for j in judged} == {"w2"}


def test_a_frozen_owner_is_fenced_out_once_its_lease_expires() -> None:
    held = dataclasses.replace(INTERRUPTED, lease_expires_at=NOW + 5)
    workers = [worker("w0", last_heartbeat=MONO - 10), worker("w1")]
    assert plan([held], workers, assigned={"s1": "w0"}) == []  # the lease still holds
    later = plan([held], workers, assigned={"s1": "w0"}, now=NOW + 6)
    assert later == [Move("s1", "w0", True), Judge("s1", Trigger.WORKER_DEATH, "w1")]


def test_a_turn_that_killed_its_worker_three_times_is_quarantined_not_assigned() -> None:
    # The engine asks for a judgement; recovery's table says quarantine; the pool carries
    # that out instead of assigning.
    [command] = plan([INTERRUPTED], [worker("w0")])
    assert isinstance(command, Judge)
    facts = Interruption("t1", TailClass.TOOL_RESULT_NOT_CONSUMED, NOW - 5, attempts=3)
    decision = decide(facts, command.trigger, NOW, False, RecoveryConfig())
    assert decision.quarantine
    assert engine.after_judgement(decision, command.trigger) == (Next.CARRY_OUT, None)


@pytest.mark.parametrize(
    ("action", "trigger", "expected"),
    [
        (Action.CONTINUE, Trigger.WORKER_DEATH, (Next.CONTINUE, AssignReason.ADOPT)),
        (Action.CONTINUE, Trigger.BOOT_SCAN, (Next.CONTINUE, AssignReason.RESTART)),
        (Action.CONTINUE, Trigger.FIRST_TOUCH, (Next.CONTINUE, AssignReason.RESTART)),
        (Action.DRIVE_WITH_QUEUED_MESSAGE, Trigger.USER_MESSAGE, (Next.DRIVE, AssignReason.NEW)),
        (Action.CONTINUE_AT, Trigger.WORKER_DEATH, (Next.CARRY_OUT, None)),
        (Action.NOTICE_RESEND, Trigger.WORKER_DEATH, (Next.CARRY_OUT, None)),
        (Action.FINALIZE_STALE, Trigger.BOOT_SCAN, (Next.CARRY_OUT, None)),
        (Action.SKIP, Trigger.RETRY_TIMER, (Next.CARRY_OUT, None)),
    ],
)
def test_after_judgement(
    action: Action, trigger: Trigger, expected: tuple[Next, AssignReason | None]
) -> None:
    assert engine.after_judgement(Decision(action, "why"), trigger) == expected


def test_a_charge_clears_what_held_the_session_back() -> None:
    memory = Memory(died=True, picked=Trigger.BOOT_SCAN, due=NOW, quiet=("x",), settled=("y",))
    after = engine.charged(memory, "t1", NOW)
    assert after == Memory(died=True, last_attempt=("t1", NOW))


# --- after a grant ------------------------------------------------------------------

G = engine.Granted


@pytest.mark.parametrize(
    ("continuation", "leased", "moved_on", "raced", "alive", "charged", "then"),
    [
        (False, True, False, False, True, False, G.ASSIGN),  # new input, leased
        (False, False, False, False, True, False, G.DROPPED),  # no lease
        (False, True, False, False, False, False, G.DROPPED),  # its worker died meanwhile
        (False, False, False, True, True, False, G.DROPPED),  # another daemon took it
        (True, True, False, False, True, True, G.ASSIGN),  # a continuation, charged
        (True, True, False, False, False, True, G.REFUND),  # charged, no worker to take it
        (True, False, True, False, True, False, G.SKIPPED),  # the turn moved on: no charge
        (True, False, False, True, True, False, G.SKIPPED),  # raced: no charge
        (True, False, False, False, True, False, G.DROPPED),  # no lease, not charged
    ],
)
def test_after_a_grant_a_continuation_is_charged_with_its_lease_or_given_back(
    continuation: bool,
    leased: bool,
    moved_on: bool,
    raced: bool,
    alive: bool,
    charged: bool,
    then: engine.Granted,
) -> None:
    after = engine.after_grant(
        continuation=continuation, leased=leased, moved_on=moved_on, raced=raced, alive=alive
    )
    assert after == engine.AfterGrant(charged, then)


# --- what recovery remembers: one record, changed by events -----------------------------


def test_the_recollection_is_changed_only_through_its_events() -> None:
    r = engine.Recollection()
    with pytest.raises(TypeError):
        r.memory["s1"] = Memory()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.of("s1").died = True  # type: ignore[misc]
    assert r.touched("s1") and not r.touched("s1")  # a first touch once
    r.died(["s2"])
    r.picked(["s3"], Trigger.BOOT_SCAN)
    assert r.attention() == {"s1", "s2", "s3"}
    assert r.of("s2").died and r.of("s3").picked is Trigger.BOOT_SCAN
    r.assigned("s2")
    assert not r.of("s2").died
    r.assigned("nobody")  # nothing is remembered of a session by its assignment alone
    assert "nobody" not in r.memory


def test_a_skip_is_logged_once_until_the_breaker_changes() -> None:
    r = engine.Recollection()
    assert r.skipped("s1", ("facts",), ("why", Trigger.FIRST_TOUCH))
    assert not r.skipped("s1", ("facts",), ("why", Trigger.FIRST_TOUCH))
    assert r.of("s1").settled == ("facts",)
    assert r.skipped("s1", ("facts",), ("other", Trigger.FIRST_TOUCH))
    r.forget_quiet()
    assert r.of("s1").quiet is None and r.of("s1").settled == ("facts",)
    assert r.quieted("s1", ("x",)) and not r.quieted("s1", ("x",))


def test_an_attempt_scheduled_charged_refunded_and_ended() -> None:
    r = engine.Recollection()
    assert r.scheduled("s1", NOW + 5) and not r.scheduled("s1", NOW + 5)
    assert r.attention() == {"s1"} and r.next_due_in(NOW) == 5
    assert r.next_due_in(NOW + 6) == float("inf")  # come due: the pass at that time has it
    r.charged("s1", "t1", NOW)
    assert r.of("s1") == Memory(last_attempt=("t1", NOW))
    r.refunded("s1", "t0")  # another turn's: kept
    assert r.of("s1").last_attempt == ("t1", NOW)
    r.refunded("s1", "t1")
    assert r.of("s1").last_attempt is None
    r.picked(["s1"], Trigger.RETRY_TIMER)
    r.scheduled("s1", NOW + 1)
    r.ended("s1")
    assert (r.of("s1").due, r.of("s1").picked) == (None, None)


def test_an_attempt_a_boot_scan_scheduled_is_judged_when_it_comes_due() -> None:
    # An earlier boot charged two attempts and was restarted in place: the third is due
    # 8 s after the second began, and this boot's scan found it not due yet.
    earlier = SessionView(
        "s1", owner="host/boot0000/w0.2", lease_expires_at=NOW - 1, active_turn_id="t1"
    )
    r = engine.Recollection()
    assert r.scheduled("s1", NOW + 8, Trigger.BOOT_SCAN)
    assert r.of("s1").picked is Trigger.BOOT_SCAN  # the scan's pick, judged at its time
    assert plan([earlier], [worker("w0.1")], memory=dict(r.memory), now=NOW + 7.9) == []
    assert plan([earlier], [worker("w0.1")], memory=dict(r.memory), now=NOW + 8) == [
        Judge("s1", Trigger.BOOT_SCAN, "w0.1")
    ]
    # A touch, a message or a worker's death schedule nothing a scan would take over.
    assert r.scheduled("s2", NOW + 8, Trigger.FIRST_TOUCH) and r.of("s2").picked is None
    assert not r.scheduled("s1", NOW + 8, Trigger.RETRY_TIMER)  # picked once already


def test_a_pass_keeps_in_view_only_what_is_still_owed_a_judgement() -> None:
    r = engine.Recollection()
    r.touched("touched")
    r.died(["dead"])
    r.picked(["picked"], Trigger.BOOT_SCAN)
    r.scheduled("due", NOW + 1)
    r.died(["served"])
    everyone = r.attention()
    r.served({"served"}, everyone - {"served"}, found=everyone - {"gone"})
    assert r.attention() == {"dead", "picked", "due"}
    r.died(["gone"])
    r.served(set(), {"gone"}, found=set())  # no work left: out of view
    assert "gone" not in r.attention()


# --- the boot scan and the retry timer ------------------------------------------------

EARLIER = "host/oldboot1/w0.1"  # a worker of an earlier boot of this host


@pytest.mark.parametrize(
    ("row", "memory", "expected"),
    [
        pytest.param({"owner": EARLIER}, None, Trigger.BOOT_SCAN, id="an-earlier-boots-turn"),
        pytest.param({"owner": None}, None, Trigger.BOOT_SCAN, id="no-owner"),
        pytest.param(
            {"owner": EARLIER, "kind": "autonomous"},
            None,
            Trigger.AUTONOMOUS_RESUME,
            id="an-autonomous-run",
        ),
        pytest.param({"active_turn_id": None}, None, None, id="no-turn-in-flight"),
        pytest.param({"owner": "other/b/w0"}, None, None, id="another-hosts"),
        pytest.param({"owner": OURS}, None, None, id="this-boots-worker"),
        pytest.param(
            {"owner": EARLIER}, Memory(picked=Trigger.BOOT_SCAN), None, id="already-picked"
        ),
    ],
)
def test_scan_targets(row: dict[str, Any], memory: Memory | None, expected: Trigger | None) -> None:
    session = dataclasses.replace(INTERRUPTED, **row)
    found = engine.scan_targets(
        [session], {"s1": memory} if memory else {}, FACTS, Trigger.BOOT_SCAN
    )
    assert found == ([(session, expected)] if expected else [])


def test_the_boot_scan_continues_at_most_max_per_pass_of_what_it_finds() -> None:
    from supervisor.core.recovery import boot_scan_plan

    sessions = [
        SessionView(f"s{i}", owner=EARLIER, active_turn_id="t", lease_expires_at=NOW - 1)
        for i in range(1_500)
    ]
    targets = engine.scan_targets(sessions, {}, FACTS, Trigger.BOOT_SCAN)
    interrupted_at = {s.id: NOW - 1_500 + i for i, (s, _) in enumerate(targets)}
    plan_ = boot_scan_plan(interrupted_at.items(), 10)
    assert plan_ == [f"s{i}" for i in range(10)]  # oldest first
    # Once picked, the engine judges exactly those, within the budget of each pass.
    memory = {sid: Memory(picked=Trigger.BOOT_SCAN) for sid in plan_}
    judged = plan(sessions, [worker("w0")], memory=memory)
    assert [c.session for c in judged] == plan_
    assert all(isinstance(c, Judge) and c.trigger is Trigger.BOOT_SCAN for c in judged)


# --- the runner's choice -----------------------------------------------------------------

RUNNER: list[tuple[str, dict[str, Any], str, Step]] = [
    ("newer token", {"lease_token": 8}, "new", Step.LEASE_LOST),
    ("nothing to do", {}, "new", Step.IDLE),
    ("quarantined", {"status": "quarantined", "pending": True}, "new", Step.IDLE),
    ("pending input", {"pending": True}, "new", Step.START),
    ("interrupted turn", {"active_turn_id": "t"}, "adopt", Step.CONTINUE),
    ("queued message on it", {"active_turn_id": "t", "pending": True}, "new", Step.SUPERSEDE),
    ("handed over mid-turn", {"active_turn_id": "t", "pending": True}, "handoff", Step.CONTINUE),
]


@pytest.mark.parametrize(
    ("row", "reason", "step"), [r[1:] for r in RUNNER], ids=[r[0] for r in RUNNER]
)
def test_runner_step(row: dict[str, Any], reason: str, step: Step) -> None:
    session = dataclasses.replace(SessionView("s", lease_token=7), **row)
    assert engine.runner_step(session, 7, reason) is step


# --- the pool over time, as a state machine ------------------------------------------------


@dataclasses.dataclass
class Row:
    """A session row as the store keeps it, in the model."""

    id: str
    pending: bool = False
    seq: int = 0
    turn: str | None = None
    owner: str | None = None
    expires: float | None = None
    token: int = 0

    def view(self) -> SessionView:
        return SessionView(
            self.id, self.owner, self.expires, self.pending, self.seq, self.turn, self.token
        )


class Pool(RuleBasedStateMachine):
    """The pool's bookkeeping around `plan`, with the I/O replaced by a few dicts.

    Judgements always continue (the fast path); leases last `STALE` seconds and are
    renewed while their owner lives; workers die, hang and are replaced (a rolling
    restart retires them all); user input keeps arriving.
    """

    STALE = 10.0
    BUDGET = Budget(assign=3, judge=2)

    @initialize(n=st.integers(1, 3))
    def start(self, n: int) -> None:
        self.now = NOW
        self.mono = MONO
        self.rows: dict[str, Row] = {}
        self.workers: dict[str, WorkerView] = {}
        self.generation = 0
        self.assigned: dict[str, str] = {}
        self.woken: dict[str, int] = {}
        self.recollection = engine.Recollection()
        self.token = 0
        self.last: list[Command] = []  # the latest pass's plan
        self.seen: dict[str, WorkerView] = {}  # the workers as it saw them
        self.waiting_input: dict[str, int] = {}  # session -> passes since its input came
        for _ in range(n):
            self._spawn()

    def _spawn(self, *, spare: bool = False) -> str:
        self.generation += 1
        name = f"w{self.generation}"
        self.workers[name] = worker(name, spare=spare, last_heartbeat=self.mono)
        return name

    @rule(interrupted=st.integers(0, 30))
    def restart_with_a_backlog(self, interrupted: int) -> None:
        """Turns an earlier boot left: its workers are gone, recovery died-marks them."""
        for i in range(interrupted):
            sid = f"old{len(self.rows)}-{i}"
            self.rows[sid] = Row(sid, turn="t", owner=f"{BOOT}/gone", expires=self.now - 1)
            self.recollection.died([sid])

    @rule(data=st.data())
    def user_input(self, data: st.DataObject) -> None:
        choices = [*self.rows, f"new{len(self.rows)}"]
        sid = data.draw(st.sampled_from(choices))
        row = self.rows.setdefault(sid, Row(sid))
        row.pending, row.seq = True, row.seq + 1
        self.waiting_input.setdefault(sid, 0)

    @rule(data=st.data())
    def a_worker_dies(self, data: st.DataObject) -> None:
        alive = [w for w in self.workers.values() if w.alive]
        if alive:
            dead = data.draw(st.sampled_from(alive))
            self.workers[dead.name] = dataclasses.replace(dead, alive=False)
            for sid, owner in self.assigned.items():
                if owner == dead.name:
                    self.recollection.died([sid])
            self._spawn(spare=True)

    @rule(data=st.data())
    def a_worker_hangs(self, data: st.DataObject) -> None:
        alive = [w for w in self.workers.values() if w.alive and w.last_heartbeat >= self.mono]
        if alive:
            hung = data.draw(st.sampled_from(alive))
            self.workers[hung.name] = dataclasses.replace(hung, last_heartbeat=-1e9)

    @rule()
    def rolling_restart(self) -> None:
        for name, w in list(self.workers.items()):
            if w.alive and not w.retiring:
                self.workers[name] = dataclasses.replace(w, retiring=True)
                self._spawn()

    @rule()
    def turns_end(self) -> None:
        """Owners with a live lease finish their turns and read their input."""
        for sid, owner in self.assigned.items():
            row = self.rows[sid]
            if self.workers[owner].alive and row.expires is not None and row.expires >= self.now:
                row.turn, row.pending = None, False
                self.waiting_input.pop(sid, None)

    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.mono += seconds
        for name, w in self.workers.items():
            if w.alive and w.last_heartbeat >= 0:
                self.workers[name] = dataclasses.replace(w, last_heartbeat=self.mono)
        for sid, owner in self.assigned.items():  # live, non-hung owners renew
            w = self.workers[owner]
            if w.alive and w.last_heartbeat >= 0:
                self.rows[sid].expires = self.now + self.STALE

    @rule()
    def dispatch(self) -> None:
        with_work = [r.view() for r in self.rows.values() if r.pending or r.turn]
        # Oldest first, pending or not: the engine must not rely on the store's order.
        loads = {n: sum(1 for o in self.assigned.values() if o == n) for n in self.workers}
        views = {n: dataclasses.replace(w, sessions=loads[n]) for n, w in self.workers.items()}
        self.seen = views
        self.last = engine.plan(
            with_work,
            views,
            self.assigned,
            self.woken,
            self.recollection.memory,
            dataclasses.replace(FACTS, budget=self.BUDGET),
            now=self.now,
            wall=self.now,
            monotonic=self.mono,
        )
        for command in self.last:
            match command:
                case Wake():
                    self.woken[command.session] = command.seq
                case Move():
                    del self.assigned[command.session]
                case Assign() | Judge():
                    self._lease(command.session, command.worker)
        fresh = self.mono - engine.HEARTBEATS_MISSED * FACTS.heartbeat_interval
        if any(engine.takes_sessions(w, fresh) for w in views.values()):
            for sid in self.waiting_input:
                if sid not in self.assigned:
                    self.waiting_input[sid] += 1

    def _lease(self, sid: str, name: str) -> None:
        self.token += 1
        row = self.rows[sid]
        row.owner, row.expires, row.token = f"{BOOT}/{name}", self.now + self.STALE, self.token
        self.assigned[sid] = name
        self.woken[sid] = row.seq
        self.recollection.assigned(sid)

    @invariant()
    def commands_go_to_workers_that_take_sessions(self) -> None:
        for command in self.last:
            if isinstance(command, Assign | Judge):
                w = self.seen[command.worker]  # as the pass saw it
                assert w.alive and not w.retiring and w.last_heartbeat >= 0, command

    @invariant()
    def each_pass_keeps_its_budget_and_touches_a_session_once(self) -> None:
        assigns = [c for c in self.last if isinstance(c, Assign)]
        judges = [c for c in self.last if isinstance(c, Judge)]
        assert len(assigns) <= self.BUDGET.assign and len(judges) <= self.BUDGET.judge
        started = [c.session for c in [*assigns, *judges]]
        assert len(started) == len(set(started))

    @invariant()
    def user_input_is_planned_before_recovery(self) -> None:
        kinds = [
            getattr(c, "trigger", None) in (None, Trigger.USER_MESSAGE)
            for c in self.last
            if isinstance(c, Assign | Judge)
        ]
        assert kinds == sorted(kinds, reverse=True), self.last

    @invariant()
    def nobody_owns_a_session_twice(self) -> None:
        for sid, name in self.assigned.items():
            assert self.rows[sid].owner == f"{BOOT}/{name}"

    @invariant()
    def input_is_never_starved(self) -> None:
        # Input left without an owner while a worker could take it waits a pass per
        # pending session at most, however long the backlog of interrupted turns.
        pending = sum(1 for r in self.rows.values() if r.pending)
        for sid, passes in self.waiting_input.items():
            assert passes <= 1 + pending, (sid, passes)


TestPool = Pool.TestCase
TestPool.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


# --- the store's half: pending input comes back first -----------------------------------


@pytest.mark.parametrize("db_url", BACKENDS, indirect=True)
def test_with_work_returns_new_input_while_more_than_its_limit_of_turns_wait(store: Any) -> None:
    from supervisor.store.models import Session

    rows = [
        {
            "id": f"old{i:05}",
            "kind": "attached",
            "created_at": 1.0 + i,
            "updated_at": 1.0 + i,
            "active_turn_id": f"t{i}",
        }
        for i in range(1_001)
    ]
    rows.append({"id": "new", "kind": "attached", "created_at": 9e9, "updated_at": 9e9})
    rows[-1]["pending"] = True
    rows.append({**rows[5], "id": "closed", "status": "closed", "pending": True})
    with store.db.atomic():
        for start in range(0, len(rows), 200):
            Session.insert_many(rows[start : start + 200]).execute()
    found = store.sessions.with_work(limit=1_000)
    assert found[0].id == "new"
    assert [s.id for s in found[1:4]] == ["old00000", "old00001", "old00002"]
    assert len(found) == 1_000 and "closed" not in {s.id for s in found}
    plan_ = plan([SessionView.of(s) for s in found], [worker("w0")])
    assert plan_[0] == Assign("new", "w0", AssignReason.NEW)
