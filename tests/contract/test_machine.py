"""The child state machine of design §4, as data and as stored (STYLE habits 1 and 2).

1. ``machine.TRANSITIONS`` is the table design §4 describes; every (state, trigger) pair
   is walked: allowed pairs give the table's target, all others raise
   ``IllegalTransition``; terminal states have no way out; ``sources``/``target``
   agree with the table.
2. The same walk against the real store: ``children.transition`` on a real row of a
   migrated SQLite file succeeds exactly when the table allows it, and otherwise
   raises ``IllegalTransition`` and leaves the row as it was (zero matched rows is an
   error, never a silent no-op).
3. A Hypothesis rule-based machine fires random triggers at one real row and checks,
   after every step, the stored state against ``machine.next_state`` and the
   invariants the CHECK constraints back.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy import Connection, create_engine, event, select

from delegation import errors, machine
from delegation.machine import State, Trigger
from delegation.store import children
from delegation.store.tables import children as children_table
from delegation.store.tables import engine_instances

P, A, R, D, C = State.PREPARED, State.ADMITTED, State.RUNNING, State.DONE, State.CANCELLED
W, Q = State.WAITING, State.QUEUED

# design §4, written out independently of the module under test.
EXPECTED: dict[tuple[State, Trigger], State] = {
    (P, Trigger.ADMIT): A,  # the run called admit()
    (A, Trigger.RUN): R,  # executing under a live host instance
    (R, Trigger.SUSPEND): A,  # its host instance went away: resumed on boot (§7)
    # "the run returned" — also before admission ("prepare or the run failed first")
    (P, Trigger.FINISH): D,
    (A, Trigger.FINISH): D,
    (R, Trigger.FINISH): D,
    # cancellation requested and the run stopped — also "cancelled first"
    (P, Trigger.STOP): C,
    (A, Trigger.STOP): C,
    (R, Trigger.STOP): C,
    # design §21: a run waited past hold_s; what it waited for came; a cancel of a child
    # that waits (no run to stop); a waiting child whose record no longer decodes ends
    (R, Trigger.WAIT): W,
    (W, Trigger.WAKE): A,
    (W, Trigger.STOP): C,
    (W, Trigger.FINISH): D,
    # design §22: a reserved child, or a woken one, waits its turn; its turn admits it;
    # a cancel, release, expiry or queue timeout ends it unprepared; an unreadable one
    (P, Trigger.QUEUE): Q,
    (W, Trigger.QUEUE): Q,
    (Q, Trigger.DEQUEUE): A,
    (Q, Trigger.STOP): C,
    (Q, Trigger.FINISH): D,
}

PAIRS = list(itertools.product(State, Trigger))
PAIR_IDS = [f"{s.value}-{t.value}" for s, t in PAIRS]


# --- 1. the table --------------------------------------------------------------------------


def test_transition_table_is_the_spec() -> None:
    assert dict(machine.TRANSITIONS) == EXPECTED
    assert {D, C} == machine.TERMINAL
    assert {P, Q, A, R, W} == machine.ACTIVE
    assert {A, R} == machine.SLOTTED
    assert set(State) == machine.TERMINAL | machine.ACTIVE


@pytest.mark.parametrize(("state", "trigger"), PAIRS, ids=PAIR_IDS)
def test_next_state_of_every_pair(state: State, trigger: Trigger) -> None:
    if (state, trigger) in EXPECTED:
        assert machine.next_state(state, trigger) is EXPECTED[(state, trigger)]
    else:
        with pytest.raises(errors.IllegalTransition) as refused:
            machine.next_state(state, trigger)
        assert trigger.value in str(refused.value)
        assert state.value in str(refused.value)


@pytest.mark.parametrize("state", sorted(machine.TERMINAL))
def test_terminal_states_have_no_way_out(state: State) -> None:
    assert not [key for key in machine.TRANSITIONS if key[0] is state]
    for trigger in Trigger:
        with pytest.raises(errors.IllegalTransition):
            machine.next_state(state, trigger)


@pytest.mark.parametrize("trigger", list(Trigger))
def test_sources_and_target_agree_with_the_table(trigger: Trigger) -> None:
    allowed = {s: to for (s, t), to in EXPECTED.items() if t is trigger}
    assert allowed, f"{trigger} can never fire"
    assert machine.sources(trigger) == set(allowed)
    assert {machine.target(trigger)} == set(allowed.values())
    for state in State:
        if state in machine.sources(trigger):
            assert machine.next_state(state, trigger) is machine.target(trigger)


def test_every_state_is_reachable_from_prepared() -> None:
    seen, frontier = {P}, [P]
    while frontier:
        state = frontier.pop()
        for (source, _), to in machine.TRANSITIONS.items():
            if source is state and to not in seen:
                seen.add(to)
                frontier.append(to)
    assert seen == set(State)


def test_admission_path_leads_from_prepared_to_running() -> None:
    assert machine.path((Trigger.ADMIT, Trigger.RUN)) == (frozenset({P}), R)
    assert machine.path((Trigger.FINISH,)) == (machine.sources(Trigger.FINISH), D)


@pytest.mark.parametrize(
    "chain",
    [(Trigger.RUN, Trigger.ADMIT), (Trigger.FINISH, Trigger.RUN), (Trigger.ADMIT, Trigger.ADMIT)],
)
def test_a_chain_that_cannot_follow_itself_is_refused(chain: tuple[Trigger, ...]) -> None:
    with pytest.raises(ValueError, match="cannot follow"):
        machine.path(chain)


# --- 2. the same walk against the real store ------------------------------------------------

T0 = 1_800_000_000.0
NOW = T0 + 100.0
OWNER = "h-owner"

# The columns a row needs in each state (the CHECKs of tables.children).
STATE_FIELDS: dict[State, dict[str, Any]] = {
    P: {},
    A: {"admitted_at": T0 + 1},
    R: {"admitted_at": T0 + 1, "engine_instance_id": OWNER},
    W: {"admitted_at": T0 + 1, "engine_instance_id": OWNER, "wake_at": T0 + 50},
    Q: {"queued_at": T0 + 1, "queue_tag": 0.0},
    D: {"admitted_at": T0 + 1, "finished_at": T0 + 2, "error": "boom"},
    C: {
        "finished_at": T0 + 2,
        "cancel_requested_at": T0 + 1,
        "cancel_reason": "cancelled: lease released",
    },
}

# The fields each trigger is fired with, as service.py fires them.
TRIGGER_FIELDS: dict[Trigger, dict[str, Any]] = {
    Trigger.ADMIT: {"admitted_at": NOW},
    Trigger.RUN: {"engine_instance_id": OWNER},
    Trigger.FINISH: {"error": ""},
    Trigger.STOP: {"error": "cancelled: by test"},
    Trigger.SUSPEND: {},
    Trigger.WAIT: {"wake_at": NOW + 60},
    Trigger.WAKE: {"wake_at": None},
    Trigger.QUEUE: {"queued_at": NOW, "queue_tag": 1.0},
    Trigger.DEQUEUE: {"admitted_at": NOW, "engine_instance_id": OWNER},
}


@pytest.fixture
def conn(db_path: Path) -> Iterator[Connection]:
    """A synchronous connection to the migrated template copy, foreign keys on, with
    the host instance the rows name as their owner."""
    engine = create_engine(f"sqlite:///{db_path}")

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA foreign_keys=ON")
        # Durability is not under test here; thousands of commits should be quick.
        dbapi_connection.execute("PRAGMA synchronous=OFF")

    try:
        with engine.connect() as connection:
            connection.execute(engine_instances.insert().values(id=OWNER, started_at=T0))
            connection.commit()
            yield connection
    finally:
        engine.dispose()


def _insert(conn: Connection, n: int, state: State) -> int:
    return children.insert_child(
        conn,
        conversation_id=f"c-{n}",
        run_id=f"run-{n}",
        grant_id=None,
        request_id=f"q-{n}",
        runner_id="runner-1",
        runner_host_instance_id="host-a",
        parent_conversation_id="parent-conv",
        parent_run_id="parent-run",
        extension_id="ext",
        profile="worker",
        generation=7,
        request=b'{"message":"do the task"}',
        preset=b'{"name":"worker"}',
        cwd="/w",
        depth=1,
        created_at=T0,
        state=state.value,
        **STATE_FIELDS[state],
    ).id


def _row(conn: Connection, child_id: int) -> dict[str, Any]:
    row = conn.execute(select(children_table).where(children_table.c.id == child_id)).one()
    return dict(row._mapping)


@pytest.mark.parametrize(("state", "trigger"), PAIRS, ids=PAIR_IDS)
def test_store_transition_of_every_pair(conn: Connection, state: State, trigger: Trigger) -> None:
    child_id = _insert(conn, 1, state)
    conn.commit()
    before = _row(conn, child_id)
    assert before["state"] == state.value
    fields = TRIGGER_FIELDS[trigger]

    if (state, trigger) not in EXPECTED:
        with pytest.raises(errors.IllegalTransition) as refused:
            children.transition(conn, child_id, trigger, NOW, **fields)
        assert state.value in str(refused.value)
        assert _row(conn, child_id) == before  # inside the transaction already
        conn.commit()
        assert _row(conn, child_id) == before
        return

    to = EXPECTED[(state, trigger)]
    assert children.transition(conn, child_id, trigger, NOW, **fields) is to
    conn.commit()
    after = _row(conn, child_id)
    changed = {"state": to.value, "updated_at": NOW, **fields}
    if to in machine.TERMINAL:
        changed["finished_at"] = NOW
    assert after == {**before, **changed}


@pytest.mark.parametrize("trigger", list(Trigger))
def test_store_transition_of_a_missing_child_is_an_error(
    conn: Connection, trigger: Trigger
) -> None:
    with pytest.raises(errors.IllegalTransition):
        children.transition(conn, 404, trigger, NOW, **TRIGGER_FIELDS[trigger])


def test_store_transition_touches_only_its_child(conn: Connection) -> None:
    target, sibling = _insert(conn, 1, P), _insert(conn, 2, P)
    conn.commit()
    untouched = _row(conn, sibling)
    children.transition(conn, target, Trigger.STOP, NOW, error="cancelled")
    conn.commit()
    assert _row(conn, target)["state"] == C.value
    assert _row(conn, sibling) == untouched


ADMISSION = (Trigger.ADMIT, Trigger.RUN)
RUNNING = {"admitted_at": NOW, "engine_instance_id": OWNER}


@pytest.mark.parametrize("state", list(State))
def test_store_advance_fires_the_admission_in_one_update(conn: Connection, state: State) -> None:
    child_id = _insert(conn, 1, state)
    conn.commit()
    before = _row(conn, child_id)
    record = children.advance(conn, child_id, ADMISSION, NOW, RUNNING)
    conn.commit()
    if state is not P:
        assert record is None
        assert _row(conn, child_id) == before
        return
    after = _row(conn, child_id)
    assert after == {**before, **RUNNING, "state": R.value, "updated_at": NOW}
    assert record is not None
    assert (record.id, record.state, record.admitted_at) == (child_id, R.value, NOW)
    assert record.engine_instance_id == OWNER


def test_store_advance_unless_cancelled_leaves_a_cancelled_request_alone(
    conn: Connection,
) -> None:
    asked, free = _insert(conn, 1, P), _insert(conn, 2, P)
    children.request_cancel(conn, [asked], NOW, "cancelled: by test")
    conn.commit()
    before = _row(conn, asked)
    assert children.advance(conn, asked, ADMISSION, NOW, RUNNING, unless_cancelled=True) is None
    assert _row(conn, asked) == before
    admitted = children.advance(conn, free, ADMISSION, NOW, RUNNING, unless_cancelled=True)
    conn.commit()
    assert admitted is not None and admitted.state == R.value


# --- 3. random trigger sequences against the model ------------------------------------------


class ChildLifecycle(RuleBasedStateMachine):
    """One real child row, driven by random triggers, shadowed by ``machine.next_state``."""

    conn: Connection
    numbers: Iterator[int]

    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.child_id = _insert(self.conn, next(self.numbers), P)
        self.conn.commit()
        self.model = P

    def _stored(self) -> dict[str, Any]:
        return _row(self.conn, self.child_id)

    @rule(trigger=st.sampled_from(Trigger), tick=st.floats(0.001, 60.0))
    def fire(self, trigger: Trigger, tick: float) -> None:
        self.now += tick
        before = self._stored()
        fields = dict(TRIGGER_FIELDS[trigger])
        if trigger is Trigger.ADMIT:
            fields["admitted_at"] = self.now
        try:
            expected: State | None = machine.next_state(self.model, trigger)
        except errors.IllegalTransition:
            expected = None

        if expected is None:
            with pytest.raises(errors.IllegalTransition):
                children.transition(self.conn, self.child_id, trigger, self.now, **fields)
            self.conn.rollback()
            assert self._stored() == before, "a refused trigger changed the row"
            return

        assert children.transition(self.conn, self.child_id, trigger, self.now, **fields) is (
            expected
        )
        self.conn.commit()
        self.model = expected
        after = self._stored()
        assert after["updated_at"] == self.now
        if expected in machine.TERMINAL:
            assert after["finished_at"] == self.now

    @invariant()
    def stored_state_is_the_model(self) -> None:
        assert self._stored()["state"] == self.model.value

    @invariant()
    def timestamps_follow_the_state(self) -> None:
        row = self._stored()
        state = State(row["state"])
        assert (row["finished_at"] is not None) == (state in machine.TERMINAL)
        if state in (A, R, W):
            assert row["admitted_at"] is not None
        if state is P:
            assert row["admitted_at"] is None
        if state is R:
            assert row["engine_instance_id"] == OWNER


def test_random_trigger_sequences_follow_the_model(conn: Connection) -> None:
    ChildLifecycle.conn = conn
    ChildLifecycle.numbers = itertools.count(1)
    run_state_machine_as_test(
        ChildLifecycle,
        settings=settings(max_examples=50, stateful_step_count=20, deadline=None, database=None),
    )


def test_boot_statements_fire_only_transitions_of_the_table() -> None:
    """The set-based boot statements take their target states from the table, and a
    statement that would move a child along a missing transition cannot be built."""
    from delegation.store import lifecycle

    assert lifecycle._fire(Trigger.SUSPEND, ["running"]) == "state = 'admitted'"
    assert lifecycle._fire(Trigger.STOP, ["admitted", "running"]) == "state = 'cancelled'"
    with pytest.raises(ValueError, match="suspend cannot fire"):
        lifecycle._fire(Trigger.SUSPEND, ["prepared"])
