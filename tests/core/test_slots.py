"""The worker-slot state machine, driven directly with made-up times."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor.core.slots import BackoffPolicy, Slot, SlotError, SlotState, Transition, all_fatal

S = SlotState


def run(slot: Slot, *, ready: bool, ran: float = 1.0, requested: bool = False) -> float:
    """Start `slot` when due, optionally report ready, let it exit `ran` s later.

    Returns the delay until the restart (or -1.0 when the slot did not go to BACKOFF).
    """
    now = slot.restart_at
    assert now is not None
    slot.start(now)
    if ready:
        slot.ready(now)
    transition = slot.exited(now + ran, requested=requested)
    return -1.0 if transition.restart_at is None else transition.restart_at - (now + ran)


def in_state(state: SlotState) -> Slot:
    """A slot that got to `state` by ordinary events."""
    slot = Slot(0)
    if state is S.STOPPED:
        slot.stop_requested()
    elif state is S.FATAL:
        for _ in range(5):
            run(slot, ready=False)
    elif state is S.BACKOFF:
        run(slot, ready=False)
    else:
        slot.start(slot.restart_at or 0.0)
        if state is S.RUNNING:
            slot.ready(1.0)
    assert slot.state is state
    return slot


# -- starting ---------------------------------------------------------------------------


def test_new_slot_is_due_at_once() -> None:
    slot = Slot(2)
    assert (slot.state, slot.restart_at, slot.generation) == (S.BACKOFF, 0.0, 0)
    assert slot.due(0.0)


@pytest.mark.parametrize(
    ("slot", "state", "due_at_10"),
    [
        (Slot(0), S.BACKOFF, True),
        (Slot(0, restart_at=12.0), S.BACKOFF, False),
        (Slot(0, state=S.STOPPED), S.STOPPED, False),
        (Slot(0, state=S.FATAL), S.FATAL, False),
        (Slot(0, state=S.RUNNING, generation=4, ready_at=3.0), S.RUNNING, False),
    ],
)
def test_explicit_initial_state(slot: Slot, state: SlotState, due_at_10: bool) -> None:
    assert slot.state is state
    assert slot.due(10.0) is due_at_10


@pytest.mark.parametrize("state", [S.STARTING, S.RUNNING])
def test_live_initial_state_needs_a_generation(state: SlotState) -> None:
    with pytest.raises(SlotError, match="generation"):
        Slot(0, state=state)


def test_start_only_when_due() -> None:
    slot = Slot(0, restart_at=5.0)
    with pytest.raises(SlotError, match="not due until 5"):
        slot.start(4.9)
    assert (slot.state, slot.generation) == (S.BACKOFF, 0)
    assert slot.start(5.0) == Transition("w0.1", S.BACKOFF, S.STARTING, "started", None)
    assert not slot.due(5.0)


def test_generation_and_identity_go_up_on_every_start() -> None:
    slot = Slot(3)
    assert slot.identity == "w3.0"
    names = []
    for ready, requested in [(True, True), (True, False), (False, False), (False, True)]:
        now = slot.restart_at or 0.0
        names.append(slot.start(now).identity)
        assert slot.identity == names[-1]
        if ready:
            slot.ready(now)
        # the exit is reported about the worker that died, not its successor
        assert slot.exited(now + 1.0, requested=requested).identity == names[-1]
    assert names == ["w3.1", "w3.2", "w3.3", "w3.4"]


# -- ready ------------------------------------------------------------------------------


def test_ready_moves_starting_to_running_and_records_the_time() -> None:
    slot = in_state(S.STARTING)
    transition = slot.ready(1.5)
    assert (transition.old, transition.new, transition.changed) == (S.STARTING, S.RUNNING, True)
    assert slot.ready_at == 1.5


@pytest.mark.parametrize("state", [S.BACKOFF, S.RUNNING, S.FATAL, S.STOPPED])
def test_late_ready_is_ignored(state: SlotState) -> None:
    slot = in_state(state)
    before = (slot.ready_at, slot.restart_at, slot.failed_starts, slot.crashes, slot.generation)
    transition = slot.ready(50.0)
    assert (transition.old, transition.new, transition.changed) == (state, state, False)
    assert "late ready" in transition.reason
    assert slot.state is state
    assert (slot.ready_at, slot.restart_at, slot.failed_starts, slot.crashes, slot.generation) == (
        before
    )


# -- crashes and backoff ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("deaths", "delays"),
    [
        # c: crash after ready, f: death before ready (a failed start)
        ("cccccccc", [0.5, 1, 2, 4, 8, 16, 30, 30]),
        ("ffff", [0.5, 1, 2, 4]),
        ("ffffcc", [0.5, 1, 2, 4, 8, 16]),  # both kinds count towards one backoff
        ("cfcfcfcf", [0.5, 1, 2, 4, 8, 16, 30, 30]),
    ],
)
def test_backoff_delays(deaths: str, delays: list[float]) -> None:
    slot = Slot(0)
    assert [run(slot, ready=death == "c") for death in deaths] == delays
    assert slot.crashes == len(deaths)


def test_backoff_is_capped_even_after_a_very_long_crash_loop() -> None:
    policy = BackoffPolicy()
    assert policy.delay(5000) == 30.0
    slot = Slot(0)
    slot.crashes = 5000
    assert run(slot, ready=True) == 30.0


@pytest.mark.parametrize(
    ("ran", "delay", "crashes"),
    [
        (59.9, 2.0, 3),  # not long enough: third crash in a row
        (60.0, 0.5, 1),  # healthy: treated as the first crash
        (3600.0, 0.5, 1),
    ],
)
def test_healthy_running_resets_the_count(ran: float, delay: float, crashes: int) -> None:
    slot = Slot(0)
    assert [run(slot, ready=True), run(slot, ready=False)] == [0.5, 1.0]
    assert run(slot, ready=True, ran=ran) == pytest.approx(delay)
    assert (slot.crashes, slot.failed_starts) == (crashes, 0)


def test_failed_start_after_a_healthy_run_is_not_forgiven() -> None:
    # only time spent RUNNING counts as healthy, not time spent starting
    slot = Slot(0)
    run(slot, ready=True)
    assert run(slot, ready=False, ran=120.0) == 1.0


@pytest.mark.parametrize("ready", [False, True])
def test_requested_exit_is_not_a_crash(ready: bool) -> None:
    slot = Slot(0)
    run(slot, ready=False)
    run(slot, ready=True)
    counters = (slot.crashes, slot.failed_starts)
    now = slot.restart_at
    assert now is not None
    slot.start(now)
    if ready:
        slot.ready(now)
    transition = slot.exited(now + 5.0, requested=True)
    assert (transition.new, transition.restart_at) == (S.BACKOFF, now + 5.0)  # due at once
    assert slot.due(now + 5.0)
    assert (slot.crashes, slot.failed_starts) == counters
    assert run(slot, ready=True) == 2.0  # the next crash is the third in a row


def test_requested_exit_after_a_healthy_run_clears_the_count() -> None:
    slot = Slot(0)
    run(slot, ready=True)
    run(slot, ready=True)
    assert run(slot, ready=True, ran=60.0, requested=True) == 0.0
    assert slot.crashes == 0
    assert run(slot, ready=True) == 0.5


# -- fatal ------------------------------------------------------------------------------


def test_five_failed_starts_in_a_row_are_fatal() -> None:
    slot = Slot(0)
    assert [run(slot, ready=False) for _ in range(4)] == [0.5, 1, 2, 4]
    assert slot.state is S.BACKOFF and not all_fatal([slot])
    now = slot.restart_at
    assert now is not None
    slot.start(now)
    transition = slot.exited(now + 0.1, requested=False)
    assert (transition.old, transition.new, transition.restart_at) == (S.STARTING, S.FATAL, None)
    assert "5 times in a row" in transition.reason
    assert slot.failed_starts == 5
    assert not slot.due(now + 1e9)
    assert all_fatal([slot])


def test_a_ready_between_failed_starts_breaks_the_streak() -> None:
    slot = Slot(0)
    for _ in range(4):
        run(slot, ready=False)
    run(slot, ready=True)  # it did start, then crashed: not fatal
    assert (slot.state, slot.failed_starts, slot.crashes) == (S.BACKOFF, 0, 5)
    for _ in range(4):
        run(slot, ready=False)
    assert slot.state is S.BACKOFF
    run(slot, ready=False)
    assert slot.state is S.FATAL


def test_a_requested_exit_neither_counts_nor_breaks_the_streak() -> None:
    slot = Slot(0)
    for _ in range(4):
        run(slot, ready=False)
    run(slot, ready=False, requested=True)  # e.g. a rolling restart while it was starting
    assert (slot.state, slot.failed_starts) == (S.BACKOFF, 4)
    run(slot, ready=False)
    assert slot.state is S.FATAL


def test_policy_is_configurable() -> None:
    policy = BackoffPolicy(initial=1.0, factor=3.0, cap=10.0, max_failed_starts=2)
    slot = Slot(0, policy)
    assert [run(slot, ready=True) for _ in range(4)] == [1.0, 3.0, 9.0, 10.0]
    run(slot, ready=False)
    assert slot.state is S.BACKOFF
    run(slot, ready=False)
    assert slot.state is S.FATAL


@pytest.mark.parametrize(
    "kwargs", [{"initial": 0.0}, {"initial": 40.0}, {"factor": 0.5}, {"max_failed_starts": 0}]
)
def test_nonsense_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="initial"):
        BackoffPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], False),
        ([S.FATAL], True),
        ([S.FATAL, S.FATAL, S.FATAL], True),
        ([S.FATAL, S.BACKOFF, S.FATAL], False),
        ([S.FATAL, S.STOPPED], False),
    ],
)
def test_all_fatal(states: list[SlotState], expected: bool) -> None:
    assert all_fatal(in_state(state) for state in states) is expected


# -- stopping ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "requested", "after_stop", "after_exit"),
    [
        (S.BACKOFF, None, S.STOPPED, None),  # stopped at once
        (S.STARTING, True, S.STARTING, S.STOPPED),
        (S.RUNNING, True, S.RUNNING, S.STOPPED),
        (S.RUNNING, False, S.RUNNING, S.STOPPED),  # a crash during the stop is not restarted
        (S.STARTING, False, S.STARTING, S.STOPPED),
        (S.FATAL, None, S.FATAL, None),
        (S.STOPPED, None, S.STOPPED, None),
    ],
)
def test_stop_requested(
    state: SlotState,
    requested: bool | None,
    after_stop: SlotState,
    after_exit: SlotState | None,
) -> None:
    slot = in_state(state)
    transition = slot.stop_requested()
    assert (transition.old, transition.new) == (state, after_stop)
    assert slot.stopping and slot.state is after_stop
    if requested is not None:
        counters = (slot.crashes, slot.failed_starts)
        assert slot.exited(100.0, requested=requested).new is after_exit
        assert (slot.crashes, slot.failed_starts) == counters
    assert not slot.due(1e9)
    with pytest.raises(SlotError):
        slot.start(1e9)


# -- refused events ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.BACKOFF, "exit"),
        (S.FATAL, "exit"),
        (S.STOPPED, "exit"),
        (S.STARTING, "start"),
        (S.RUNNING, "start"),
        (S.FATAL, "start"),
        (S.STOPPED, "start"),
    ],
)
def test_invalid_transitions_raise(state: SlotState, event: str) -> None:
    slot = in_state(state)
    identity, counters = slot.identity, (slot.crashes, slot.failed_starts)
    with pytest.raises(
        SlotError, match=rf"{identity}: cannot {event} a slot that is {state.value}"
    ):
        if event == "exit":
            slot.exited(1e9, requested=False)
        else:
            slot.start(1e9)
    assert (slot.state, slot.identity, (slot.crashes, slot.failed_starts)) == (
        state,
        identity,
        counters,
    )


# -- random sequences -------------------------------------------------------------------

TIME_STEPS = st.one_of(st.sampled_from([0.0, 0.5, 30.0, 59.9, 60.0]), st.floats(0.0, 120.0))


class SlotMachine(RuleBasedStateMachine):
    """Random events against one slot, checked against a tiny model of the rules."""

    def __init__(self) -> None:
        super().__init__()
        self.slot = Slot(0)
        self.now = 0.0
        self.failed_in_a_row = 0  # unrequested deaths before ready since the last ready
        self.final: SlotState | None = None

    @rule(dt=TIME_STEPS)
    def advance(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.slot.due(self.now))
    @rule()
    def start(self) -> None:
        generation = self.slot.generation
        assert self.slot.start(self.now).new is S.STARTING
        assert self.slot.generation == generation + 1
        assert self.slot.identity == f"w0.{generation + 1}"

    @rule()
    def ready(self) -> None:
        was = self.slot.state
        transition = self.slot.ready(self.now)
        assert transition.changed is (was is S.STARTING)
        if was is S.STARTING:
            self.failed_in_a_row = 0

    @rule(requested=st.booleans())
    def exit(self, requested: bool) -> None:
        was = self.slot.state
        crashes, failed_starts = self.slot.crashes, self.slot.failed_starts
        if was not in (S.STARTING, S.RUNNING):
            with pytest.raises(SlotError):
                self.slot.exited(self.now, requested)
            return
        transition = self.slot.exited(self.now, requested)
        if requested or self.slot.stopping:
            assert self.slot.crashes <= crashes
            assert self.slot.failed_starts <= failed_starts
            assert transition.new is (S.STOPPED if self.slot.stopping else S.BACKOFF)
            assert transition.restart_at in (None, self.now)
            return
        if was is S.STARTING:
            self.failed_in_a_row += 1
        assert self.slot.failed_starts == self.failed_in_a_row
        assert (transition.new is S.FATAL) is (self.failed_in_a_row == 5)
        if transition.new is S.BACKOFF:
            assert transition.restart_at is not None
            delay = transition.restart_at - self.now
            assert 0.5 - 1e-9 <= delay <= 30.0 + 1e-9  # float subtraction: 0.5025 - 0.0025

    @rule(roll=st.integers(0, 9))
    def stop(self, roll: int) -> None:
        if roll == 0:  # rarely, so most sequences get far before the pool stops
            self.slot.stop_requested()

    @invariant()
    def final_states_are_absorbing(self) -> None:
        if self.final is not None:
            assert self.slot.state is self.final
        elif self.slot.state in (S.FATAL, S.STOPPED):
            self.final = self.slot.state

    @invariant()
    def counters_are_sane(self) -> None:
        assert 0 <= self.slot.failed_starts <= min(self.slot.crashes, 5)
        assert (self.slot.state is S.FATAL) is (self.slot.failed_starts == 5)
        assert (self.slot.restart_at is not None) is (self.slot.state is S.BACKOFF)


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
