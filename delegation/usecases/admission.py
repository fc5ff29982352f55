"""Admission waits its turn (design §22), on the database's side: each function is part
of one write transaction (see :mod:`delegation.usecases.service`).

A child some policy applies to enters admission at its reservation: it takes a slot
of every scope that applies at once (``prepared`` → ``admitted``, before ``prepare``
runs) when each has one free, a rate token, and nobody queued before it; otherwise it
is ``queued``. A child woken from ``waiting`` asks for its slot again the same way. The
engine's pump (:mod:`delegation.engine.admission`) admits the queue in order as slots
free: ``queued`` → ``admitted`` under the host that runs it.

Every decision reads the policies locked (PostgreSQL: ``FOR UPDATE``; SQLite has one
writer), then counts the slots in use: two hosts never both take the last slot. Slots
are derived from states (``admitted`` and ``running`` children a policy admitted), so a
child that ends, waits or is ended by a takeover gives its slot back with its state.

The queue's order is one key, ``queue_tag``: the child's turn plus its priority's head
start, ``(9 - priority) * AGING`` turns. A parent's next child takes the turn after its
parent's last one (queued or served: a parent's turns never go back), or the newest turn
served if that is later: parents are served round-robin (ties go to the older child),
and a child woken from ``waiting`` whose slot is taken, or whose scope has a queue,
queues as its parent's next child.
Priority is a head start, not a band (SPEC §31): a queued child waits behind at most
``AGING * d + 1`` of another parent's children queued after it, ``d`` the levels their
priority is above its own (73 at most, from 0 to 9; the 1: the turn they share),
however many that parent queues; and a scope's ``max_priority`` caps what its children
may ask.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from delegation import errors
from delegation.config import AdmissionPolicy
from delegation.machine import State, Trigger
from delegation.options import ExecutionOptions
from delegation.records import RECOVERY_KIND, ChildRecord, Resumable
from delegation.store import admission, children, controls, events, lifecycle
from delegation.store.admission import PolicyRow
from delegation.store.events import EventRow
from delegation.store.sql import Connection, run
from delegation.usecases import stored, versions

AGING = 8.0  # the turns of head start one level of priority gives
SCAN_MOST = 100_000  # queued children one turn of the pump looks at, at most
_DEQUEUE = (Trigger.DEQUEUE,)
QUEUE_TIMED_OUT = "cancelled: admission wait timed out"
DEADLINE_EXCEEDED = "cancelled: child deadline exceeded"
WOKEN_TEXT = "resumed after waiting"
_UNREADABLE = errors.ChildUnreadable.default_message()
_json = msgspec.json.Encoder()


def scopes_of(runner_id: str, extension_id: str, profile: str, parent: str) -> tuple[str, ...]:
    """Every scope a child of this preset and parent conversation is in."""
    return (
        f"runner:{runner_id}",
        f"extension:{runner_id}/{extension_id}",
        f"preset:{runner_id}/{extension_id}/{profile}",
        f"parent:{parent}",
    )


def child_scopes(child: ChildRecord) -> tuple[str, ...]:
    return scopes_of(
        child.runner_id, child.extension_id, child.profile, child.parent_conversation_id
    )


@dataclass(slots=True)
class Gate:
    """The policies, locked for this transaction, and what each has free now."""

    now: float
    rows: dict[str, PolicyRow]
    _free: dict[str, float] = field(default_factory=dict)
    _tokens: dict[str, float] = field(default_factory=dict)
    _queued: dict[str, int] = field(default_factory=dict)

    @classmethod
    def open(cls, conn: Connection, now: float) -> Gate | None:
        """None when no policy exists."""
        rows = admission.policies(conn, lock=True)
        return cls(now, rows) if rows else None

    def applying(self, scopes: Iterable[str]) -> list[str]:
        return [scope for scope in scopes if scope in self.rows]

    def _slots(self, conn: Connection, scope: str) -> float:
        if scope not in self._free:
            limit = self.rows[scope].policy.concurrency
            used = 0 if limit is None else admission.slots_in_use(conn, scope)
            self._free[scope] = math.inf if limit is None else limit - used
        return self._free[scope]

    def _token(self, scope: str) -> float:
        if scope not in self._tokens:
            row = self.rows[scope]
            if row.policy.rate is None:
                self._tokens[scope] = math.inf
            else:
                n, per = row.policy.rate
                tokens = n if row.tokens is None else row.tokens
                since = max(0.0, self.now - (row.refilled_at or self.now))
                self._tokens[scope] = min(float(n), tokens + since * n / per)
        return self._tokens[scope]

    def admissible(self, conn: Connection, scopes: Sequence[str], *, token: bool = True) -> bool:
        return all(self._slots(conn, s) >= 1 and (not token or self._token(s) >= 1) for s in scopes)

    def take(self, scopes: Sequence[str], *, token: bool = True) -> None:
        for scope in scopes:
            self._free[scope] -= 1
            if token:
                self._tokens[scope] -= 1

    def take_first(self, conn: Connection, scopes: Sequence[str], *, token: bool = True) -> bool:
        """Take a slot (and a token) of every scope at once when each has one and nobody
        is queued in any: nothing passes a child waiting its turn. Whether it did."""
        if any(self.queued(conn, s) for s in scopes):
            return False
        if not self.admissible(conn, scopes, token=token):
            return False
        self.take(scopes, token=token)
        return True

    def exhausted(self) -> bool:
        """Whether no scope has a slot and a token left (after ``admissible`` looked)."""
        return len(self._free) == len(self.rows) and all(
            self._free[s] < 1 or self._token(s) < 1 for s in self.rows
        )

    def queued(self, conn: Connection, scope: str) -> int:
        """How many are queued in ``scope``, counted up to its ``max_queued`` (or 1)."""
        if scope not in self._queued:
            most = max(1, self.rows[scope].policy.max_queued)
            self._queued[scope] = admission.queued_in(conn, scope, most)
        return self._queued[scope]

    def save(self, conn: Connection) -> None:
        """Write back the tokens this transaction took (and their refill)."""
        for scope, tokens in self._tokens.items():
            if not math.isinf(tokens):
                admission.save_tokens(conn, scope, tokens, self.now)

    def next_token_at(self) -> float | None:
        """When the next token of a rate that ran out comes."""
        waits = []
        for scope, tokens in self._tokens.items():
            rate = self.rows[scope].policy.rate
            if rate is not None and tokens < 1:
                waits.append(self.now + (1 - tokens) * rate[1] / rate[0])
        return min(waits) if waits else None

    def timeout(self, scopes: Sequence[str]) -> float | None:
        found = [t for s in scopes if (t := self.rows[s].policy.queue_timeout_s) is not None]
        return self.now + min(found) if found else None


def deadline_at(
    conn: Connection, now: float, seconds: float | None, depth: int, parent_run_id: str
) -> float | None:
    """A child's deadline at its first admission: its own ``deadlineSeconds`` from now,
    and at most its parent's (a child of a child)."""
    own = None if seconds is None else now + float(seconds)
    parent = children.deadline_of_run(conn, parent_run_id) if depth > 1 else None
    found = [d for d in (own, parent) if d is not None]
    return min(found) if found else None


def deadline_seconds(options: ExecutionOptions | None) -> float | None:
    """A child's ``deadlineSeconds`` from its effective options (None: none)."""
    value = msgspec.UNSET if options is None else options.deadline_seconds
    return None if value is msgspec.UNSET else float(value)


def _place(conn: Connection, priority: int, parent: str) -> tuple[float, float]:
    """The turn and tag of a child of ``parent`` entering the queue."""
    turn = admission.served_turn(conn) or 0.0
    last = admission.parent_turn(conn, parent)
    if last is not None:
        turn = max(turn, last + 1)
    return turn, turn + (9 - priority) * AGING


def _cap(gate: Gate, scopes: Sequence[str], child: ChildRecord) -> None:
    """Refuse a child asking a priority above a scope's ``max_priority``.

    Raises:
        errors.PriorityAboveCap: naming the priority, the cap and its scope.
    """
    for scope in scopes:
        cap = gate.rows[scope].policy.max_priority
        if cap is not None and child.priority > cap:
            raise errors.PriorityAboveCap(
                f"child priority {child.priority} is above max_priority {cap} of admission"
                f" scope {scope}"
            )


# --- entering admission at a reservation ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Entered:
    child: ChildRecord
    queued: bool


def enter(
    conn: Connection,
    now: float,
    instance_id: str,
    child: ChildRecord,
    seconds: float | None,
) -> Entered | None:
    """A reserved child a policy applies to: admitted now (it holds its slots) or
    queued. None: no policy applies (it is admitted by its run, as ever).

    Raises:
        errors.QueueFull: it would wait in a scope whose queue is full; the caller's
            transaction writes nothing then.
        errors.PriorityAboveCap: it asks a priority above a scope's ``max_priority``
            (nothing written either).
    """
    gate = Gate.open(conn, now)
    applying = gate.applying(child_scopes(child)) if gate is not None else []
    if gate is None or not applying:
        return None
    _cap(gate, applying, child)
    if gate.take_first(conn, applying):
        gate.save(conn)
        fields = {
            "queued_at": now,
            "admitted_at": now,
            "engine_instance_id": instance_id,
            "deadline_at": deadline_at(conn, now, seconds, child.depth, child.parent_run_id),
        }
        admitted = children.advance(conn, child.id, (Trigger.QUEUE, Trigger.DEQUEUE), now, fields)
        assert admitted is not None  # inserted prepared in this very transaction
        return Entered(admitted, False)
    for scope in applying:
        if gate.queued(conn, scope) >= gate.rows[scope].policy.max_queued:
            raise errors.QueueFull()
    place = _place(conn, child.priority, child.parent_conversation_id)
    admission.enqueue(conn, child.id, State.PREPARED.value, now, place, gate.timeout(applying))
    queued = children.get(conn, child.id)
    assert queued is not None
    return Entered(queued, True)


def wake_or_queue(conn: Connection, now: float, gate: Gate | None, child: ChildRecord) -> bool:
    """A waiting child due to wake takes its slots again (True: wake it), or waits its
    turn ``queued`` as its parent's next child (False): a wake takes a turn of its
    parent's, and a free slot only when nobody is queued in its scopes, so a parent
    whose children sleep and wake in a loop cannot keep another's waiting (SPEC §31)."""
    applying = gate.applying(child_scopes(child)) if gate is not None else []
    if gate is None or not applying:
        return True
    if gate.take_first(conn, applying, token=False):
        run(  # it counts in its scopes' slots from now on, however it was admitted
            conn,
            "UPDATE children SET queued_at = COALESCE(queued_at, ?) WHERE id = ?",
            (now, child.id),
        )
        return True
    place = _place(conn, child.priority, child.parent_conversation_id)
    admission.enqueue(conn, child.id, State.WAITING.value, now, place, gate.timeout(applying))
    run(conn, "UPDATE children SET wake_at = NULL WHERE id = ?", (child.id,))
    return False


def count_wake(conn: Connection, child_id: int, note: str = "") -> None:
    """Count a wake and commit its ``recovery`` event (a resume, as at boot); ``note``
    ends its text (a change of runner version, design §34)."""
    row = run(
        conn,
        "UPDATE children SET wakes = wakes + 1 WHERE id = ? RETURNING wakes,"
        " (SELECT COALESCE(MAX(sequence), 0) + 1 FROM events WHERE child_id = ?)",
        (child_id, child_id),
    ).fetchone()
    wakes, sequence = int(row[0]), int(row[1])
    body = _json.encode(
        {"sequence": sequence, "kind": RECOVERY_KIND, "text": f"{WOKEN_TEXT} (wake {wakes}){note}"}
    )
    events.insert_events(conn, [EventRow(child_id, sequence, body, None)])


# --- the pump -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dequeued:
    """What one turn of the pump committed: fresh children admitted here (to spawn),
    children woken before that resume here, those it ended (unreadable), the children
    whose wait timed out or whose deadline passed, and when to look again for a rate."""

    fresh: list[tuple[ChildRecord, bytes | None]]  # each with its grant's policy
    resumable: list[Resumable]
    unreadable: list[str]
    ended: list[int]
    next_token_at: float | None
    more: bool  # it stopped at its limit: more may be admissible
    next_due: float | None = None  # the next queue timeout or deadline of what nothing runs
    refused: list[str] = field(default_factory=list)  # ended: another runner version ran them


def dequeue(
    conn: Connection,
    now: float,
    instance_id: str,
    limit: int = 256,
    host: versions.HostVersion = versions.UNVERSIONED,
) -> Dequeued:
    """End the queued children whose wait timed out and what nothing runs past its
    deadline, then admit the queue in order while slots and tokens last (at most
    ``limit``), under this host: a child woken before resumes as the host's version
    policy judges it (design §34), a fresh one is this host's version's."""
    # The policies' lock first, as every transaction that takes it does before any
    # child's row (PostgreSQL): two of them never wait on each other.
    gate = Gate.open(conn, now)
    timed_out, late = admission.due(conn, now, limit)
    ended = admission.stop_ids(conn, timed_out, now, QUEUE_TIMED_OUT)
    ended += admission.stop_ids(conn, late, now, DEADLINE_EXCEEDED)
    fresh: list[tuple[ChildRecord, bytes | None]] = []
    again: list[int] = []
    unreadable: list[str] = []
    chosen: list[admission.Queued] = []
    cancelled: list[int] = []
    refused: list[str] = []
    why: dict[int, str] = {}
    pinned = 0
    for queued in _queue(conn, SCAN_MOST):
        if queued.cancel_requested:  # asked to end before its turn: ends unprepared
            cancelled.append(queued.id)
            continue
        scopes = scopes_of(
            queued.runner_id, queued.extension_id, queued.profile, queued.parent_conversation_id
        )
        applying = gate.applying(scopes) if gate is not None else []
        if gate is not None and applying:
            if not gate.admissible(conn, applying):
                if gate.exhausted():
                    break
                continue
            gate.take(applying)
        chosen.append(queued)
        if len(chosen) >= limit:
            break
    ended += admission.stop_cancelled(conn, cancelled, now)
    records = {c.id: c for c in children.of_ids(conn, [q.id for q in chosen])} if chosen else {}
    for queued in chosen:
        child = records[queued.id]
        if queued.admitted_before:  # woken before: it resumes
            verdict = versions.verdict(child, host)
            if verdict is versions.Verdict.REFUSE:
                error = versions.refusal(child, host)
                children.transition(conn, child.id, Trigger.FINISH, now, error=error)
                refused.append(child.run_id)
                continue
            if verdict is versions.Verdict.PIN:
                pinned += versions.pin(conn, now, child, instance_id)
                continue
            mine = {"engine_instance_id": instance_id}
            # Matching only while queued and not asked to end (PostgreSQL: a cancel may
            # have committed since the queue was read).
            if children.advance(conn, child.id, _DEQUEUE, now, mine, unless_cancelled=True):
                count_wake(conn, child.id, versions.note(child, host))
                again.append(child.id)
                why[child.id] = versions.woken_by(conn, child)
            continue
        policy = grant_policy(conn, child)
        try:
            _, _, effective = stored.for_run(child.request, child.preset, child.options, policy)
        except errors.ChildUnreadable:
            children.transition(conn, child.id, Trigger.FINISH, now, error=_UNREADABLE)
            unreadable.append(child.run_id)
            continue
        fields = {
            "admitted_at": now,
            "engine_instance_id": instance_id,
            "version": host.version,  # the code that prepares it is this host's
            "attempt_version": host.version,
            "deadline_at": deadline_at(
                conn, now, deadline_seconds(effective), child.depth, child.parent_run_id
            ),
        }
        admitted = children.advance(conn, child.id, _DEQUEUE, now, fields, unless_cancelled=True)
        if admitted is not None:
            fresh.append((admitted, policy))
    taken = len(chosen)
    next_token = None
    if gate is not None:
        gate.save(conn)
        next_token = gate.next_token_at()
    resumable = [
        dataclasses.replace(item, reason=why[item.child.id])
        for item in (lifecycle.woken(conn, again, instance_id, now) if again else [])
    ]
    versions.attempted(conn, again, host)
    if pinned:
        controls.wake(conn)  # a host of their version takes them
    due = admission.next_due(conn)
    return Dequeued(fresh, resumable, unreadable, ended, next_token, taken >= limit, due, refused)


def _queue(conn: Connection, most: int) -> Iterator[admission.Queued]:
    """The queue in order, read a few at a time (most turns admit a handful), at most
    ``most`` children."""
    after: tuple[float, int] | None = None
    size, seen = 16, 0
    while seen < most:
        batch = admission.head(conn, min(size, most - seen), after)
        yield from batch
        if len(batch) < size:
            return
        seen += len(batch)
        after = (batch[-1].tag, batch[-1].id)
        size = min(size * 4, 1024)


def grant_policy(conn: Connection, child: ChildRecord) -> bytes | None:
    """Its grant's policy as stored (the ceiling of a child reserved before its options
    were stored)."""
    if not child.grant_id:
        return None
    row = run(conn, "SELECT policy FROM grants WHERE id = ?", (child.grant_id,)).fetchone()
    return None if row is None or row[0] is None else bytes(row[0])


def _unconstrained_first(conn: Connection) -> None:
    """After a policy is removed: the queued children no policy applies to any more go
    to the head of the queue (the pump admits them at once, holding no slot), rather
    than wait behind children of scopes still full."""
    left = admission.scopes(conn)
    free: list[int] = []
    after: tuple[float, int] | None = None
    while batch := admission.head(conn, 1024, after):
        for queued in batch:
            scopes = scopes_of(
                queued.runner_id, queued.extension_id, queued.profile, queued.parent_conversation_id
            )
            if left.isdisjoint(scopes):
                free.append(queued.id)
        after = (batch[-1].tag, batch[-1].id)
    for child_id in free:
        run(
            conn,
            "UPDATE children SET queue_tag = -1 WHERE id = ? AND state = 'queued'",
            (child_id,),
        )


def next_due(conn: Connection) -> float | None:
    return admission.next_due(conn)


def has_work(conn: Connection, now: float) -> bool:
    """Whether the pump has anything to do: a queued child, or something due."""
    if admission.any_queued(conn):
        return True
    due = admission.next_due(conn)
    return due is not None and due <= now


# --- operators ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScopeUse:
    """One policy and what its scope holds now."""

    scope: str
    row: PolicyRow
    in_use: int
    queued: int


def listing(conn: Connection) -> list[ScopeUse]:
    return [
        ScopeUse(scope, row, admission.slots_in_use(conn, scope), admission.queued_in(conn, scope))
        for scope, row in admission.policies(conn).items()
    ]


def stored_policy(conn: Connection, now: float, scope: str, policy: object | None) -> bool:
    """Store (or with None remove) the policy of ``scope``; whether anything changed."""
    if policy is None:
        removed = admission.remove(conn, scope)
        if removed:
            _unconstrained_first(conn)
        return removed
    if not isinstance(policy, AdmissionPolicy):
        raise errors.MalformedInput(
            f"malformed admission policy: expected an AdmissionPolicy or None, got"
            f" {type(policy).__name__}"
        )
    admission.put(conn, scope, policy, now)
    return True
