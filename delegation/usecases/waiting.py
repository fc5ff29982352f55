"""A child that waits (design §21), on the database's side: each function is one
transaction (see :mod:`delegation.usecases.service`).

A run asks, sleeps or waits for an event through :mod:`delegation.run.waits`,
which opens a wait here (an input request commits with its ``input-required`` event),
reads it again as news comes, and past ``hold_s`` suspends its child (``running`` →
``waiting``: the engine then ends its task, and it holds nothing). An answer
(``child.input``, the host's ``answer_input``) or an event (``send_event``) is committed
here; a waiting child it concerns is due to wake at once (``wake_at``), and the engine
that owns it wakes it: ``waiting`` → ``running`` again under it, with a ``recovery``
event, as a boot resumes a child.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import msgspec

from delegation import errors
from delegation._struct import blank, utf8_len
from delegation.config import EngineConfig
from delegation.machine import State, Trigger
from delegation.records import ChildRecord, Resumable, RunnerConnection
from delegation.store import children, controls, events, lifecycle, waits
from delegation.store.events import EventRow
from delegation.store.sql import Connection
from delegation.store.waits import INPUT_KINDS, WaitRow
from delegation.usecases import admission, service, stored, versions
from delegation.wire import MAX_MESSAGE_BYTES, Params, valid_id

WOKEN_TEXT = admission.WOKEN_TEXT
_UNREADABLE = errors.ChildUnreadable.default_message()
APPROVAL_OPTIONS = ("approve", "deny")
MAX_KEY_BYTES = 1024
_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class WaitSpec:
    """What a run waits for, as it first opens the wait."""

    kind: str  # input, approval, event, sleep
    prompt: str = ""
    options: tuple[str, ...] = ()
    tool_name: str = ""
    tool_call_id: str = ""
    input: str = ""
    event_key: str | None = None
    expires_at: float | None = None  # a timeout, or a sleep's wake time


# --- the run's side -------------------------------------------------------------------


def wait_state(conn: Connection, child_id: int, name: str) -> WaitRow | None:
    return waits.get(conn, child_id, name)


def open_wait(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    child_id: int,
    name: str,
    spec: WaitSpec,
    event: EventRow | None,
) -> WaitRow:
    """Open a wait (an input request commits with its ``input-required`` ``event``, and
    with every event its run emitted before); the wait as it is when one by that name
    is open already. An event wait takes its event at once if one was sent.

    Raises:
        errors.InputLimit: the execution has ``max_open_inputs`` open requests.
    """
    found = waits.get(conn, child_id, name)
    if found is not None:
        return found
    child = _child(conn, child_id)
    if spec.kind in INPUT_KINDS and child.inputs_open >= cfg.max_open_inputs:
        raise errors.InputLimit()
    options = json.dumps(list(spec.options)) if spec.options else None
    waits.insert(
        conn, child_id, name, spec.kind, now, prompt=spec.prompt, options=options,
        tool_name=spec.tool_name, tool_call_id=spec.tool_call_id, input_text=spec.input,
        event_key=spec.event_key, expires_at=spec.expires_at,
    )  # fmt: skip
    if event is not None:
        events.insert_events(conn, [event])
    if spec.event_key is not None:
        _take(conn, now, child, name, spec.event_key)
    return _wait(conn, child_id, name)


def take_event(conn: Connection, now: float, child_id: int, name: str) -> WaitRow:
    """An event wait, with its event taken if one was sent since."""
    found = _wait(conn, child_id, name)
    if found.event_key is not None and not found.answered and not found.closed:
        _take(conn, now, _child(conn, child_id), name, found.event_key)
        return _wait(conn, child_id, name)
    return found


def _take(conn: Connection, now: float, child: ChildRecord, name: str, key: str) -> None:
    payload = waits.take(conn, child.conversation_id, key, child.id, now)
    if payload is not None:
        waits.answer(conn, child.id, name, payload, None, now)


@dataclass(frozen=True, slots=True)
class Suspended:
    """A run's child is ``waiting`` now, woken at ``wake_at`` at the latest (None: only
    an answer or an event wakes it)."""

    wake_at: float | None


def suspend(conn: Connection, now: float, child_id: int, instance_id: str) -> Suspended | None:
    """``running`` → ``waiting``, unless one of its waits can end now (None: the run
    goes on), its cancellation was requested, or another instance runs it now."""
    children.lock(conn, child_id)
    child = _child(conn, child_id)
    if (
        child.state != State.RUNNING.value
        or child.engine_instance_id != instance_id
        or child.cancel_requested_at is not None
        or waits.ready(conn, child_id, child.conversation_id, now)
    ):
        return None
    at = waits.earliest(conn, child_id)
    children.transition(conn, child_id, Trigger.WAIT, now, wake_at=at)
    return Suspended(at)


# --- waking ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Woken:
    """What a wake-up committed: the children to run again here (``running`` under this
    instance, each with its recovery event), those it ended (their stored record no
    longer decodes), and when the next of this instance's waiting children wakes."""

    resumable: list[Resumable]
    unreadable: list[str]
    next_wake: float | None
    refused: list[str] = field(default_factory=list)  # ended: another runner version
    pinned: int = 0  # left waiting for a host of the version they ran

    @property
    def settled(self) -> int:
        """How many due children this wake-up settled (woken, ended or pinned)."""
        return len(self.resumable) + len(self.unreadable) + len(self.refused) + self.pinned


def wake_due(
    conn: Connection,
    now: float,
    instance_id: str,
    limit: int = 500,
    host: versions.HostVersion = versions.UNVERSIONED,
) -> Woken:
    """Wake this instance's waiting children that are due (at most ``limit``), each as
    the host's version policy judges it (design §34): children pinned to this host's
    version that no live host of it holds are taken first."""
    versions.claim_pinned(conn, now, instance_id, host)
    due = waits.due(conn, instance_id, now, limit)
    # The policies' lock (design §22) before any child's row, as the pump takes it.
    gate = admission.Gate.open(conn, now) if due else None
    unreadable: list[str] = []
    refused: list[str] = []
    wake: list[int] = []
    judged: dict[int, ChildRecord] = {}
    pinned = 0
    for child in children.of_ids(conn, due):
        if child.state != State.WAITING.value:
            continue
        try:
            stored.for_run(
                child.request, child.preset, child.options, admission.grant_policy(conn, child)
            )
        except errors.ChildUnreadable:
            children.transition(conn, child.id, Trigger.FINISH, now, error=_UNREADABLE)
            unreadable.append(child.run_id)
            continue
        match versions.verdict(child, host):
            case versions.Verdict.REFUSE:
                error = versions.refusal(child, host)
                children.transition(conn, child.id, Trigger.FINISH, now, error=error)
                refused.append(child.run_id)
                continue
            case versions.Verdict.PIN:
                pinned += versions.pin(conn, now, child, instance_id)
                continue
        wake.append(child.id)
        judged[child.id] = child
    # A child some policy applies to takes its slots again, or waits its turn (§22).
    woken: list[int] = []
    for child in children.of_ids(conn, wake) if gate is not None else ():
        if admission.wake_or_queue(conn, now, gate, child):
            woken.append(child.id)
    if gate is not None:
        wake = woken
    why: dict[int, str] = {}
    for child_id in wake:
        child = judged[child_id]
        why[child_id] = versions.woken_by(conn, child)
        children.transition(conn, child_id, Trigger.WAKE, now, wake_at=None)
        admission.count_wake(conn, child_id, versions.note(child, host))
    resumable = [
        dataclasses.replace(item, reason=why[item.child.id])
        for item in lifecycle.woken(conn, wake, instance_id, now)
    ]
    versions.attempted(conn, wake, host)
    if pinned:
        controls.wake(conn)  # a host of their version takes them
    return Woken(resumable, unreadable, waits.next_wake(conn, instance_id), refused, pinned)


def next_wake(conn: Connection, instance_id: str) -> float | None:
    return waits.next_wake(conn, instance_id)


# --- answers and events ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivered:
    """An answer or an event committed for a child: it is to be told (its run here) or
    woken (a waiting child this host owns); another host that runs it was woken by the
    database (``NOTIFY``) in the same commit."""

    child_id: int
    state: str
    owner: str | None
    accepted: bool = True  # an event kept (not a duplicate), an answer recorded now


def answer(
    conn: Connection, now: float, cfg: EngineConfig, rconn: RunnerConnection, params: Params
) -> Delivered:
    """``child.input``: authority as for ``child.steer``, then :func:`_answer`."""
    child = service.locate_child(conn, rconn, params, now, steer=True)
    return _answer(conn, now, child, params.input_id, params.decision, params.message,
                   params.request_id)  # fmt: skip


def answer_exact(
    conn: Connection,
    now: float,
    conversation_id: str,
    run_id: str | None,
    input_id: str,
    decision: str,
    text: str,
    request_id: str,
) -> Delivered:
    """The host's own answer (an operator's, ``delegation input``), whatever its grant."""
    child = service.exact(conn, conversation_id, run_id)
    return _answer(conn, now, child, input_id, decision, text, request_id)


def _answer(
    conn: Connection,
    now: float,
    child: ChildRecord,
    input_id: str,
    decision: str,
    text: str,
    request_id: str,
) -> Delivered:
    """Record the answer to the child's input request ``input_id``, once per request:
    the same ``request_id`` again is the same answer (idempotent, as a steer is)."""
    if not valid_id(request_id):
        raise errors.BadSteer("child input requires a valid requestId")
    found, value = answerable(conn, now, child, input_id, decision, text)
    if found.answered:
        if found.request_id == request_id and found.answer == value:
            return Delivered(child.id, child.state, child.engine_instance_id, accepted=False)
        raise errors.InputAnswered()
    waits.answer(conn, child.id, input_id, value, request_id, now)
    return _delivered(conn, now, child)


def answerable(
    conn: Connection, now: float, child: ChildRecord, input_id: str, decision: str, text: str
) -> tuple[WaitRow, bytes]:
    """The child's input request ``input_id`` (locking the child) and the answer as it
    would be recorded; an answered request is the caller's to judge.

    Raises:
        errors.InputUnknown, errors.InputClosed, errors.InputInvalid: it cannot take it.
    """
    if not isinstance(input_id, str) or not input_id or utf8_len(input_id) > MAX_KEY_BYTES:
        raise errors.InputUnknown()
    children.lock(conn, child.id)
    if child.terminal:
        raise errors.InputClosed()
    found = waits.get(conn, child.id, input_id)
    if found is None or found.kind not in INPUT_KINDS:
        raise errors.InputUnknown()
    value = _answer_value(found, decision, text)
    if not found.answered and (found.closed or found.expired(now)):
        raise errors.InputClosed()
    return found, value


def _answer_value(found: WaitRow, decision: str, text: str) -> bytes:
    """The answer as recorded (JSON): one of the request's options, or a text."""
    options = json.loads(found.options) if found.options else []
    if options:
        if decision not in options:
            raise errors.InputInvalid()
        return _json.encode(decision)
    if decision:
        raise errors.InputInvalid()
    if blank(text) or utf8_len(text) > MAX_MESSAGE_BYTES:
        raise errors.InputInvalid("child input requires a nonempty bounded text answer")
    return _json.encode(text)


def send_event(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    conversation_id: str,
    key: str,
    payload: bytes,
    idempotency_key: str | None,
) -> Delivered:
    """Keep an event for the conversation, and give it to an open wait of its newest
    execution for ``key`` at once. The first sent with a key wins while none is taken;
    an idempotency key sent again changes nothing (``accepted`` false either way).

    Raises:
        errors.ChildNotFound: no such conversation (events go to existing children).
        errors.EventClosed: its newest execution has ended (nothing is stored).
        errors.EventTooLarge: a payload over ``max_step_bytes``.
        errors.EventBufferFull: ``max_buffered_events`` wait to be taken already.
    """
    child = sendable(conn, cfg, conversation_id, key, payload, idempotency_key)
    if (
        child.terminal
        or waits.send(conn, conversation_id, key, payload, idempotency_key, now) is None
    ):
        return Delivered(child.id, child.state, child.engine_instance_id, accepted=False)
    for name in waits.event_waits(conn, child.id, key):
        _take(conn, now, child, name, key)
        return _delivered(conn, now, child)
    return Delivered(child.id, child.state, child.engine_instance_id)


def send(
    conn: Connection, now: float, cfg: EngineConfig, rconn: RunnerConnection, params: Params
) -> Delivered:
    """``child.send`` (design §33): authority as for ``child.steer``, then
    :func:`send_event` to the child's conversation with ``key`` and ``data``, sent once
    per ``requestId``."""
    if not valid_id(params.request_id):
        raise errors.BadSteer("child send requires a valid requestId")
    child = service.locate_child(conn, rconn, params, now, steer=True)
    try:
        payload = _json.encode(params.data)
    except (TypeError, msgspec.EncodeError) as exc:  # decoded from JSON: only a Python caller's
        raise errors.MalformedInput(f"malformed child input: data: {exc}") from None
    return send_event(conn, now, cfg, child.conversation_id, params.key, payload, params.request_id)


def sendable(
    conn: Connection,
    cfg: EngineConfig,
    conversation_id: str,
    key: str,
    payload: bytes,
    idempotency_key: str | None,
) -> ChildRecord:
    """The live execution of the conversation an event may be sent to (see
    :func:`send_event` for the refusals), or its newest execution, ended or not, when
    ``idempotency_key`` was sent already: sent again, it changes nothing (a retry of a
    send whose answer was lost, after the event ended the child, is not refused)."""
    if not isinstance(key, str) or blank(key) or utf8_len(key) > MAX_KEY_BYTES:
        raise errors.InputError("an event key must be nonempty text of at most 1 KiB")
    if idempotency_key is not None and not valid_id(idempotency_key):
        raise errors.InvalidId("an event's idempotency key must be a valid ID")
    if len(payload) > cfg.max_step_bytes:
        raise errors.EventTooLarge()
    child = service.exact(conn, conversation_id, None)
    if idempotency_key is not None and waits.was_sent(conn, conversation_id, idempotency_key):
        return child
    if child.terminal:
        raise errors.EventClosed()
    if waits.untaken(conn, conversation_id) >= cfg.max_buffered_events:
        raise errors.EventBufferFull()
    return child


def _delivered(conn: Connection, now: float, child: ChildRecord) -> Delivered:
    """A waiting child is due now; the host running or owning it is woken at commit."""
    waits.wake_at(conn, child.id, now)
    controls.wake(conn)
    return Delivered(child.id, child.state, child.engine_instance_id)


def _child(conn: Connection, child_id: int) -> ChildRecord:
    child = children.get(conn, child_id)
    if child is None:
        raise errors.ChildPurged()
    return child


def _wait(conn: Connection, child_id: int, name: str) -> WaitRow:
    found = waits.get(conn, child_id, name)
    assert found is not None  # opened by this run; waits leave only with their child
    return found


def open_requests(conn: Connection, child: ChildRecord) -> list[WaitRow]:
    """A child's open input requests (none read when it has none open)."""
    return waits.open_inputs(conn, child.id) if child.inputs_open else []
