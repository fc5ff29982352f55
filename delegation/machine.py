"""The child state machine of design §4, as data.

``TRANSITIONS`` is the whole truth: the store turns each trigger into one
guarded UPDATE (``WHERE state IN sources(trigger)``) and treats zero matched
rows as :class:`errors.IllegalTransition`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from functools import cache

from delegation import errors


class State(StrEnum):
    PREPARED = "prepared"
    QUEUED = "queued"  # design §22: waits its turn for a slot; no task, no process
    ADMITTED = "admitted"
    RUNNING = "running"
    WAITING = "waiting"  # design §21: it holds no task, no process and no slot
    DONE = "done"
    CANCELLED = "cancelled"


class Trigger(StrEnum):
    ADMIT = "admit"  # the run called admit(): the last moment before any effect
    RUN = "run"  # a live host instance executes the admitted child
    FINISH = "finish"  # the run returned or failed (before admission too)
    STOP = "stop"  # cancellation was requested and the run has stopped
    SUSPEND = "suspend"  # the host instance running it went away
    WAIT = "wait"  # its run waited past hold_s for an answer, a time or an event (§21)
    WAKE = "wake"  # what it waited for came (or its timeout): it resumes
    QUEUE = "queue"  # an admission policy has no slot (or token) for it yet (§22)
    DEQUEUE = "dequeue"  # its turn came: it holds a slot from now on


class Outcome(StrEnum):
    """How an execution ended: its terminal state, a ``done`` with an error told apart."""

    DONE = "done"  # the run returned
    FAILED = "failed"  # done with an error: the run raised, or never got to run
    CANCELLED = "cancelled"


def outcome(state: str, error: str) -> Outcome:
    """The outcome of a terminal execution in ``state`` that ended with ``error``."""
    if state == State.CANCELLED:
        return Outcome.CANCELLED
    return Outcome.FAILED if error else Outcome.DONE


TERMINAL: frozenset[State] = frozenset({State.DONE, State.CANCELLED})
ACTIVE: frozenset[State] = frozenset(
    {State.PREPARED, State.QUEUED, State.ADMITTED, State.RUNNING, State.WAITING}
)
# What holds an admission slot (design §22): a queued or waiting child holds none.
SLOTTED: frozenset[State] = frozenset({State.ADMITTED, State.RUNNING})

TRANSITIONS: Mapping[tuple[State, Trigger], State] = {
    (State.PREPARED, Trigger.ADMIT): State.ADMITTED,
    (State.ADMITTED, Trigger.RUN): State.RUNNING,
    (State.PREPARED, Trigger.FINISH): State.DONE,
    (State.ADMITTED, Trigger.FINISH): State.DONE,
    (State.RUNNING, Trigger.FINISH): State.DONE,
    (State.PREPARED, Trigger.STOP): State.CANCELLED,
    (State.ADMITTED, Trigger.STOP): State.CANCELLED,
    (State.RUNNING, Trigger.STOP): State.CANCELLED,
    (State.RUNNING, Trigger.SUSPEND): State.ADMITTED,
    (State.RUNNING, Trigger.WAIT): State.WAITING,
    (State.WAITING, Trigger.WAKE): State.ADMITTED,
    (State.WAITING, Trigger.STOP): State.CANCELLED,
    # A waiting child whose stored record no longer decodes cannot be woken (design §18).
    (State.WAITING, Trigger.FINISH): State.DONE,
    # Admission (design §22): a reserved child, or a woken one, waits for a slot; its
    # turn admits it (it has a slot before ``prepare`` runs). Cancel, release, expiry
    # and the queue's timeout end it unprepared; an unreadable record ends it done.
    (State.PREPARED, Trigger.QUEUE): State.QUEUED,
    (State.WAITING, Trigger.QUEUE): State.QUEUED,
    (State.QUEUED, Trigger.DEQUEUE): State.ADMITTED,
    (State.QUEUED, Trigger.STOP): State.CANCELLED,
    (State.QUEUED, Trigger.FINISH): State.DONE,
}


def next_state(state: State, trigger: Trigger) -> State:
    """The state after ``trigger`` fires in ``state``.

    Raises:
        errors.IllegalTransition: the table has no such transition.
    """
    try:
        return TRANSITIONS[(state, trigger)]
    except KeyError:
        raise errors.IllegalTransition(
            f"child state transition {trigger.value} is not allowed from {state.value}"
        ) from None


@cache
def sources(trigger: Trigger) -> frozenset[State]:
    """Every state from which ``trigger`` may fire."""
    return frozenset(state for state, t in TRANSITIONS if t is trigger)


@cache
def target(trigger: Trigger) -> State:
    """The one state ``trigger`` leads to (each trigger has a single target)."""
    (state,) = {to for (_, t), to in TRANSITIONS.items() if t is trigger}
    return state


@cache
def path(triggers: tuple[Trigger, ...]) -> tuple[frozenset[State], State]:
    """The states a chain of triggers may start from and the state it ends in, for
    firing them together in one UPDATE (e.g. admission: ADMIT then RUN).

    Raises:
        ValueError: a trigger of the chain cannot fire from where the one before leads.
    """
    start, end = sources(triggers[0]), target(triggers[0])
    for trigger in triggers[1:]:
        if end not in sources(trigger):
            raise ValueError(f"{trigger.value} cannot follow {end.value}")
        end = target(trigger)
    return start, end
