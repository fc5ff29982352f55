"""An operator's control, judged when it is given (design §33): one write transaction
beside whichever host runs, or none.

:func:`give` checks what the database can tell now — the execution exists and has not
ended, a steer's text, an input request that is open, unanswered and takes this answer,
an event's key, size and a live execution to take it, a rewind's lease, ended
conversation and recorded step — and records the control only if
it passes; otherwise it raises the refusal the host would, and nothing is recorded. The
host that owns the child applies it later (:mod:`delegation.engine.operators`) and may
still refuse it (someone answered first, the child ended meanwhile): that refusal is
kept as the control's outcome, which :func:`listed` shows.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import msgspec

from delegation import errors
from delegation._struct import blank
from delegation.config import EngineConfig
from delegation.records import ChildRecord
from delegation.store import children, controls
from delegation.store.controls import (
    Cancel,
    Control,
    ControlRecord,
    EventSend,
    InputAnswer,
    Rewind,
    Steer,
    Unpin,
    decoded,
    message_of,
)
from delegation.store.sql import Connection
from delegation.usecases import rewinding, service, waiting
from delegation.wire import valid_id

_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Given:
    """A control as recorded: its row, and the execution it names (the newest of the
    conversation when none was named)."""

    control: ControlRecord
    child: ChildRecord


def give(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    conversation_id: str,
    run_id: str | None,
    control: Control,
    request_id: str = "",
) -> Given:
    """Judge ``control`` for the execution and record it (telling the hosts at commit).
    The same ``request_id`` with the same control again is the control recorded first.

    Raises:
        errors.ChildNotFound, errors.ChildPurged: no such execution.
        errors.ChildEnded: a cancel or steer of an execution that has ended.
        errors.BadSteer, errors.InvalidId: an empty or oversized steer, a bad request id.
        errors.SteerRequestIdReused: ``request_id`` was given with another control.
        errors.InputUnknown, errors.InputClosed, errors.InputInvalid, errors.InputAnswered:
            as ``engine.answer_input`` (an answer given but not applied yet counts).
        errors.EventClosed, errors.EventTooLarge, errors.EventBufferFull, errors.InputError:
            as ``engine.send_event``.
        errors.RewindNoAuthority, errors.ActiveSubmission, errors.RewindStepUnknown: as
            ``engine.rewind_child`` (the execution named is the rewind's source).
    """
    if request_id and not valid_id(request_id):
        raise errors.InvalidId("a control's request id must be a valid ID")
    action, message = message_of(control)
    if isinstance(control, EventSend):
        run_id = None  # an event is for the conversation's live execution
    elif not request_id and isinstance(control, Steer | InputAnswer | Rewind):
        # Applied twice (a host died before recording it, two hosts at once), a steer or
        # an answer with its own request id changes nothing the second time.
        request_id = f"op-{secrets.token_hex(8)}"
    try:
        child = service.exact(conn, conversation_id, run_id)
    except (errors.ChildNotFound, errors.ChildPurged):
        # A rewind names its source: one not of this conversation (or purged) is unknown.
        if isinstance(control, Rewind) and children.find(conn, conversation_id) is not None:
            raise errors.RewindRunUnknown() from None
        raise
    children.lock(conn, child.id)  # two operators' controls of one child: one at a time
    child = children.get(conn, child.id) or child  # as it is now that it is locked
    if request_id and not isinstance(control, EventSend):  # an event: its idempotency key
        first = controls.by_request(conn, conversation_id, action, request_id)
        if first is not None:
            if first.message != message or first.run_id != _run_of(control, child):
                raise errors.SteerRequestIdReused("control requestId was already used")
            return Given(first, child)
    _judge(conn, now, cfg, child, control, request_id)
    control_id = controls.submit(
        conn, conversation_id, _run_of(control, child), action, message, request_id, now,
        notify=True,
    )  # fmt: skip
    recorded = controls.get(conn, control_id)
    assert recorded is not None  # inserted by this transaction
    return Given(recorded, child)


def _run_of(control: Control, child: ChildRecord) -> str | None:
    """The run id a control is kept for: none for an event (the conversation's)."""
    return None if isinstance(control, EventSend) else child.run_id


def _judge(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    child: ChildRecord,
    control: Control,
    request_id: str,
) -> None:
    match control:
        case Cancel() | Steer() | Unpin():
            if child.terminal:
                raise errors.ChildEnded(
                    f"child {child.conversation_id} has already ended ({child.state})"
                )
            if isinstance(control, Steer) and (
                blank(control.message) or len(control.message) > cfg.max_steer_chars
            ):
                raise errors.BadSteer("a steer needs a nonempty message within its bound")
            if isinstance(control, Unpin) and child.pinned_version is None:
                raise errors.NotPinned()
        case InputAnswer(input_id=input_id, decision=decision, text=text):
            found, _ = waiting.answerable(conn, now, child, input_id, decision, text)
            if found.answered or _pending_answer(conn, child, input_id):
                raise errors.InputAnswered()
        case Rewind(step=step):
            rewinding.judge(conn, now, child, step)
        case EventSend(key=key, payload=payload):
            body = encoded_payload(payload)
            waiting.sendable(conn, cfg, child.conversation_id, key, body, request_id or None)


def encoded_payload(payload: object) -> bytes:
    """An event's payload as kept (JSON).

    Raises:
        errors.InputError: ``payload`` is not JSON-encodable.
    """
    try:
        return _json.encode(payload)
    except (TypeError, msgspec.EncodeError) as exc:
        raise errors.InputError(f"an event's payload must be JSON-encodable: {exc}") from None


def _pending_answer(conn: Connection, child: ChildRecord, input_id: str) -> bool:
    """Whether an answer to ``input_id`` was given and is not applied yet."""
    for pending in controls.listed(conn, child.conversation_id, 1_000, pending_only=True):
        if pending.action == "input" and pending.run_id == child.run_id:
            try:
                given = decoded(pending.action, pending.message)
            except errors.MalformedInput:
                continue
            if isinstance(given, InputAnswer) and given.input_id == input_id:
                return True
    return False


@dataclass(frozen=True, slots=True)
class Outcome:
    """A control and what became of it: ``status`` ``pending`` (no host has applied it
    yet), ``applied`` or ``refused`` (``reason`` and ``error`` say why); ``fields``: what
    applying it reported (a cancel's ``state`` and ``error``, a steer's ``outcome`` and
    ``reason``, an answer's ``state``, an event's ``accepted``)."""

    id: int
    action: str
    conversation_id: str
    run_id: str | None
    request_id: str
    created_at: float
    applied_at: float | None
    status: str
    reason: str | None
    error: str | None
    fields: dict[str, Any]


def outcome_of(record: ControlRecord) -> Outcome:
    """The control request ``record`` and its outcome as stored."""
    stored: dict[str, Any] = {}
    if record.outcome is not None:
        try:
            loaded = json.loads(record.outcome)
        except ValueError:
            loaded = {"failure": "unreadable outcome", "failureReason": "internal_error"}
        stored = loaded if isinstance(loaded, dict) else {}
    failure = stored.pop("failure", None)
    reason = stored.pop("failureReason", None)
    if record.applied_at is None:
        status = "pending"
    else:
        status = "refused" if failure is not None else "applied"
    return Outcome(
        record.id, record.action, record.conversation_id, record.run_id, record.request_id,
        record.created_at, record.applied_at, status,
        None if failure is None else str(reason or "refused"),
        None if failure is None else str(failure), stored,
    )  # fmt: skip


def listed(conn: Connection, conversation_id: str | None, limit: int) -> list[Outcome]:
    """The newest ``limit`` controls (of one conversation, or all), newest first."""
    return [outcome_of(record) for record in controls.listed(conn, conversation_id, limit)]
